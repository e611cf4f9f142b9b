"""A problem's prompt as the policy sees it: the served model's chat template, tokenised.

The one place prompts are rendered, for training rollouts and for evaluation alike.
"""

from __future__ import annotations

from megatron_apriel.records.rollouts import Problem


def render_prompt(tokenizer, problem: Problem) -> list[int]:
    """Token ids of ``problem.prompt`` through ``tokenizer``'s chat template, ready for the
    assistant's turn. Function-calling problems pass their tool schemas (``metadata["tools"]``)
    to the template, which shows them the way the model was trained to read them."""
    tools = problem.metadata.get("tools")
    ids = tokenizer.apply_chat_template(problem.prompt, tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    if not ids:
        raise ValueError(f"problem {problem.id}: the chat template rendered an empty prompt.")
    return list(ids)
