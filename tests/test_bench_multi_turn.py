"""bench/multi_turn.py at tiny shape on the CPU: the three ways run through the driver's rollout
functions on real engine processes, generate the same model tokens, and the ratios are printed."""

import pytest

from bench import multi_turn as bench


@pytest.mark.timeout(120)
def test_the_benchmark_times_multi_turn_recompute_and_single_turn_side_by_side(capsys):
    results = bench.main(["--trajectories", "3", "--turns", "2", "--turn-len", "4", "--tool-len", "3"])
    ways = ("multi-turn", "recompute", "single-turn")
    assert [results[w]["tokens"] for w in ways] == [3 * 2 * 4] * 3  # model tokens only, the same in each way
    assert results["vs_single_turn"] == pytest.approx(results["multi-turn"]["tokens_per_s"]
                                                      / results["single-turn"]["tokens_per_s"])
    assert results["vs_recompute"] == pytest.approx(results["multi-turn"]["tokens_per_s"]
                                                    / results["recompute"]["tokens_per_s"])
    out = capsys.readouterr().out
    assert "vs recompute" in out and f"{results['vs_recompute']:.2f}x" in out


def test_the_generate_function_alternates_told_model_turns_and_tool_turns():
    import asyncio

    from ppo.generate.custom import Sample

    class Args:  # GenerateArgs.generate's contract (ppo/generate/custom.py): one model turn appended
        async def generate(self, sample, params):
            n = params["max_new_tokens"] - len(sample.trajectory.response_ids)
            assert params["ignore_eos"] and n == 5
            sample.trajectory.add_model_turn([1] * n, [0.0] * n, "length")
            return {}

    sample = asyncio.run(bench.make_generate(3, 5, 2, 100)(Args(), Sample(0, 0, "p", [7, 8]), {"max_new_tokens": 99}))
    assert [(t.source, len(t.ids)) for t in sample.trajectory.turns] == [
        ("model", 5), ("env", 2), ("model", 5), ("env", 2), ("model", 5)]
