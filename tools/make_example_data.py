"""Write the small sample sets under examples/data/ (about 20 problems per domain, written by us).

    PYTHONPATH=. python tools/make_example_data.py examples/data
"""

from __future__ import annotations

import sys
from pathlib import Path

import reasoning_gym

from megatron_apriel.data.converters import CODE_SUFFIX, MATH_SUFFIX
from megatron_apriel.data.datasets import write_problems
from megatron_apriel.records.rollouts import Problem

MATH = [("What is 3/4 + 1/4 - 1/2?", r"\frac{1}{2}"), ("Solve 2x + 6 = 0 for x.", "-3"),
        ("What is the sum of the interior angles of a hexagon, in degrees?", "720"),
        ("Compute 17 * 23.", "391"), ("What is the greatest common divisor of 84 and 126?", "42"),
        ("Simplify sqrt(50) / sqrt(2).", "5"), ("How many positive divisors does 36 have?", "9"),
        ("What is 2^10 mod 7?", "2"), ("Find the positive root of x^2 - 5x - 14 = 0.", "7"),
        ("What is the probability of two heads in two fair coin tosses?", r"\frac{1}{4}"),
        ("Expand (x+1)^2.", "x^2+2x+1"), ("What is log base 2 of 64?", "6"),
        ("How many ways can 4 distinct books be arranged on a shelf?", "24"),
        ("What is the area of a circle of radius 3?", r"9\pi"), ("Evaluate 1 + 2 + ... + 100.", "5050"),
        ("What is the hypotenuse of a right triangle with legs 5 and 12?", "13"),
        ("Write 0.125 as a fraction in lowest terms.", r"\frac{1}{8}"),
        ("What is sqrt(2) squared times sqrt(2)?", r"2\sqrt{2}"),
        ("What is the smallest prime greater than 90?", "97"), ("Solve for y: y/3 = 1.5.", "4.5")]

CODE = [
    ("Read two integers a and b on one line and print a + b.", [("2 3\n", "5"), ("-1 1\n", "0")]),
    ("Read n, then n integers on the next line; print their maximum.", [("3\n1 9 4\n", "9"), ("1\n-5\n", "-5")]),
    ("Read a string and print it reversed.", [("abc\n", "cba"), ("racecar\n", "racecar")]),
    ("Read n and print n! .", [("5\n", "120"), ("0\n", "1")]),
    ("Read n and print YES if n is prime, else NO.", [("7\n", "YES"), ("9\n", "NO"), ("2\n", "YES")]),
    ("Read a line of words and print how many words it has.", [("a bb ccc\n", "3"), ("one\n", "1")]),
    ("Read n and print the n-th Fibonacci number (F0=0, F1=1).", [("10\n", "55"), ("1\n", "1")]),
    ("Read n integers on one line (n unknown) and print them sorted ascending, space separated.",
     [("3 1 2\n", "1 2 3"), ("5\n", "5")]),
    ("Read a string and print the number of vowels (aeiou, lower case) in it.", [("hello\n", "2"), ("xyz\n", "0")]),
    ("Read a and b and print their greatest common divisor.", [("12 18\n", "6"), ("7 5\n", "1")]),
]
CODE_FN = [
    ("add", "Write a function add(a, b) returning a + b.", [([1, 2], 3), ([-4, 4], 0)]),
    ("is_palindrome", "Write is_palindrome(s) returning True if s reads the same backwards.",
     [(["abba"], True), (["abc"], False)]),
    ("two_sum", "Write two_sum(nums, target) returning the indices [i, j] (i < j) of two numbers adding to target.",
     [([[2, 7, 11, 15], 9], [0, 1]), ([[3, 2, 4], 6], [1, 2])]),
    ("count_chars", "Write count_chars(s) returning a dict from each character to its count.",
     [(["aab"], {"a": 2, "b": 1}), ([""], {})]),
    ("flatten", "Write flatten(xs) flattening one level of nesting: [[1], [2, 3]] -> [1, 2, 3].",
     [([[[1], [2, 3]]], [1, 2, 3]), ([[]], [])]),
    ("mean", "Write mean(xs) returning the arithmetic mean of a non-empty list as a float.",
     [([[1, 2, 3, 4]], 2.5), ([[5]], 5.0)]),
    ("rotate", "Write rotate(xs, k) rotating the list right by k places.",
     [([[1, 2, 3, 4], 1], [4, 1, 2, 3]), ([[1, 2], 4], [1, 2])]),
    ("missing_number", "Write missing_number(nums): nums holds 0..n with one number missing; return it.",
     [([[3, 0, 1]], 2), ([[0]], 1)]),
    ("capitalize_words", "Write capitalize_words(s) upper-casing the first letter of every word.",
     [(["hello world"], "Hello World")]),
    ("binary", "Write binary(n) returning the binary representation of n >= 0 without prefix.",
     [([5], "101"), ([0], "0")]),
]

LOGIC_TASKS = ["mini_sudoku", "knights_knaves", "syllogism", "word_sorting", "letter_counting",
               "basic_arithmetic", "number_sorting", "spell_backward"]
I3_LOGIC = [
    ("web_of_lies", "Ann tells the truth. Bob says Ann lies. Cid says Bob lies. Does Cid tell the truth? "
                    "Answer Yes or No in \\boxed{}.", "Yes"),
    ("boolean_expressions", "Evaluate: not ( True and False ) or False. Answer True or False in \\boxed{}.", "True"),
    ("object_counting", "I have a piano, two flutes and a violin. How many musical instruments do I have? "
                        "Answer in \\boxed{}.", "4"),
    ("word_sorting", "Sort these words alphabetically and give them as a Python list in \\boxed{}: pear, apple, fig.",
     "['apple', 'fig', 'pear']"),
]

IFEVAL = [
    ("Describe a sunrise in fewer than 40 words, without using any commas.",
     ["length_constraints:number_words", "punctuation:no_comma"], [{"num_words": 40, "relation": "less than"}, {}]),
    ("Write a haiku about rain, entirely in lowercase letters.", ["change_case:english_lowercase"], [{}]),
    ("List three fruits as a markdown bullet list with exactly 3 bullets.",
     ["detectable_format:number_bullet_lists"], [{"num_bullets": 3}]),
    ("Explain gravity to a child. Include the keywords 'apple' and 'earth'.",
     ["keywords:existence"], [{"keywords": ["apple", "earth"]}]),
    ("Give a title wrapped in double angular brackets, like <<title>>, then a one-line poem.",
     ["detectable_format:title"], [{}]),
    ("Write a short note to a friend and end it with a postscript starting with P.S.",
     ["detectable_content:postscript"], [{"postscript_marker": "P.S."}]),
    ("Answer in JSON only: what is the capital of France?", ["detectable_format:json_format"], [{}]),
    ("Write two paragraphs about cats, separated by the markdown divider ***.",
     ["length_constraints:number_paragraphs"], [{"num_paragraphs": 2}]),
    ("Shout a greeting: your whole answer must be in capital letters.", ["change_case:english_capital"], [{}]),
    ("Wrap your entire answer in double quotation marks. What is your favourite colour?", ["startend:quotation"], [{}]),
    ("Describe the sea. Finish your response with the exact phrase 'Is there anything else I can help with?'",
     ["startend:end_checker"], [{"end_phrase": "Is there anything else I can help with?"}]),
    ("Write a product blurb with at least 2 placeholders in square brackets such as [name].",
     ["detectable_content:number_placeholders"], [{"num_placeholders": 2}]),
    ("Tell me about trees without using the words 'green' or 'leaf'.",
     ["keywords:forbidden_words"], [{"forbidden_words": ["green", "leaf"]}]),
    ("Write about running; use the word 'fast' at least 3 times.",
     ["keywords:frequency"], [{"keyword": "fast", "frequency": 3, "relation": "at least"}]),
    ("Write a limerick with the letter 'z' appearing at least 4 times.",
     ["keywords:letter_frequency"], [{"letter": "z", "let_frequency": 4, "let_relation": "at least"}]),
    ("Give two different answers to: what is a good pet? Separate them with six asterisks ******.",
     ["combination:two_responses"], [{}]),
    ("Write a plan with 2 sections, each starting with 'SECTION X'.",
     ["detectable_format:multiple_sections"], [{"section_spliter": "SECTION", "num_sections": 2}]),
    ("Highlight at least 2 parts of your answer with markdown, i.e. *highlighted section*. Topic: bees.",
     ["detectable_format:number_highlighted_sections"], [{"num_highlights": 2}]),
    ("Is the sky blue? Answer with one of: My answer is yes., My answer is no., My answer is maybe.",
     ["detectable_format:constrained_response"], [{}]),
    ("Write at least 30 words about the moon, all lowercase, with no commas.",
     ["length_constraints:number_words", "change_case:english_lowercase", "punctuation:no_comma"],
     [{"num_words": 30, "relation": "at least"}, {}, {}]),
]

WEATHER = {"name": "get_weather", "description": "Current weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}
CONVERT = {"name": "convert_currency", "description": "Convert an amount between currencies.", "parameters": {
    "type": "object", "properties": {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                                     "to_currency": {"type": "string"}},
    "required": ["amount", "from_currency", "to_currency"]}}
SEARCH = {"name": "search_books", "description": "Search a library catalogue.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
    "required": ["query"]}}
TOOLS = [WEATHER, CONVERT, SEARCH]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito"]
FC = ([(f"What's the weather in {c}?", [{"get_weather": {"city": [c], "unit": ["", "celsius", "fahrenheit"]}}])
       for c in CITIES]
      + [(f"What's the weather in {c} in fahrenheit?", [{"get_weather": {"city": [c], "unit": ["fahrenheit"]}}])
         for c in CITIES[:3]]
      + [(f"Convert {a} {f} to {t}.", [{"convert_currency": {"amount": [float(a)], "from_currency": [f],
                                                             "to_currency": [t]}}])
         for a, f, t in [(100, "USD", "EUR"), (25, "GBP", "JPY"), (7.5, "EUR", "CHF")]]
      + [(f"Find up to {n} books about {q}.", [{"search_books": {"query": [q], "max_results": [n]}}])
         for q, n in [("volcanoes", 5), ("chess", 3)]]
      + [("Find books about knots.", [{"search_books": {"query": ["knots"], "max_results": ["", 10]}}])]
      + [(f"Weather in {a} and in {b}, please.", [{"get_weather": {"city": [a], "unit": [""]}},
                                                  {"get_weather": {"city": [b], "unit": [""]}}])
         for a, b in [("Paris", "Rome"), ("Tokyo", "Seoul"), ("Lima", "Quito")]]
      + [("Weather in Oslo, and convert 10 NOK to EUR.",
          [{"get_weather": {"city": ["Oslo"], "unit": [""]}},
           {"convert_currency": {"amount": [10.0], "from_currency": ["NOK"], "to_currency": ["EUR"]}}])])


def _user(text):
    return [{"role": "user", "content": text}]


def build() -> dict[str, list[Problem]]:
    out = {"math": [Problem(f"math-{i:02d}", "math", _user(q + MATH_SUFFIX), a, {"source": "handwritten"})
                    for i, (q, a) in enumerate(MATH)]}
    code = [Problem(f"code-{i:02d}", "code", _user(q + CODE_SUFFIX),
                    {"tests": [{"input": x, "output": y} for x, y in tests]}, {"source": "handwritten"})
            for i, (q, tests) in enumerate(CODE)]
    code += [Problem(f"code-fn-{i:02d}", "code", _user(q + CODE_SUFFIX),
                     {"fn_name": fn, "tests": [{"input": x, "output": y} for x, y in tests]}, {"source": "handwritten"})
             for i, (fn, q, tests) in enumerate(CODE_FN)]
    out["code"] = code
    logic = []
    for task in LOGIC_TASKS:
        for i, entry in enumerate(reasoning_gym.create_dataset(task, size=2, seed=1234)):
            logic.append(Problem(f"logic-{task}-{i}", "logic",
                                 _user(entry["question"] + "\n\nPut your final answer within \\boxed{}."),
                                 {"source": "reasoning_gym", "task": task, "entry": entry},
                                 {"source": "reasoning_gym"}))
    logic += [Problem(f"logic-i3-{i}", "logic", _user(q),
                      {"source": "i3_logic", "task": t, "answer": a, "game_data": {}},
                      {"source": "handwritten_i3_format"}) for i, (t, q, a) in enumerate(I3_LOGIC)]
    out["logic"] = logic
    out["ifeval"] = [Problem(f"ifeval-{i:02d}", "ifeval", _user(q), {"instruction_id_list": ids, "kwargs": kw},
                             {"source": "handwritten"}) for i, (q, ids, kw) in enumerate(IFEVAL)]
    out["function_calling"] = [Problem(f"fc-{i:02d}", "function_calling", _user(q),
                                       {"ground_truth": gold, "functions": TOOLS},
                                       {"source": "handwritten", "tools": TOOLS})
                               for i, (q, gold) in enumerate(FC)]
    return out


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/data")
    root.mkdir(parents=True, exist_ok=True)
    for domain, problems in build().items():
        print(domain, write_problems(root / f"{domain}.jsonl", problems))


if __name__ == "__main__":
    main()
