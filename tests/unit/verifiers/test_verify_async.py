import asyncio

from megatron_apriel.verifiers import Outcome, make_verifier_pool, verify_async
from tests.unit.conftest import apriel, make_problem


def test_verify_async_in_process_pool_does_not_block_loop():
    async def main(pool):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)
        task = asyncio.create_task(ticker())
        results = await asyncio.gather(
            verify_async("math", make_problem("math", "0.5"), apriel(r"\boxed{\frac{1}{2}}"), pool),
            verify_async("math", make_problem("math", "0.5"), apriel(r"\boxed{2}"), pool),
            verify_async("function_calling", make_problem("function_calling", {"ground_truth": [{"f": {}}]}),
                         apriel('<tool_calls>[{"name": "f", "arguments": {}}]</tool_calls>'), pool))
        task.cancel()
        return results, ticks

    with make_verifier_pool(max_workers=2) as pool:
        (ok, wrong, fc), ticks = asyncio.run(main(pool))
    assert ok.success and wrong.outcome is Outcome.WRONG and fc.success
    assert ticks > 5  # the loop kept running while workers started and verified
