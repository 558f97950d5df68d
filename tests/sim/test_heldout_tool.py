"""tools/heldout_sweep.py, the held-out check of issue 13's goal 2 (kvdb never below LRU - 0.005):
it replays real generated traces, and it does flag a policy that falls below LRU."""

from __future__ import annotations

from helpers import load_tool


def test_kvdb_passes_a_small_held_out_sweep_and_the_summary_names_every_variant(capsys):
    tool = load_tool("heldout_sweep")
    # 12 sessions keep it quick; at 1 % such traces leave 12-44 blocks, less than two calls, and
    # kvdb falls below LRU in some of those cells (docs/planner.md "Limits")
    code = tool.main(["--variants", "default,wrong", "--seeds", "7", "--fractions", "0.02,0.05", "--sessions", "12"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4 cells, 0 below LRU" in out
    for v in ("default", "wrong"):
        assert len([ln for ln in out.splitlines() if ln.split()[:1] == [v]]) == 2  # one row per fraction


def test_a_policy_below_lru_fails_the_check():
    # LFU keeps the first rounds' hot blocks long after they went cold: below LRU on these traces
    tool = load_tool("heldout_sweep")
    cells = tool.sweep(["mix"], [7], [0.01], sessions=12, policy="lfu")
    (cell,) = cells
    assert cell["kvdb"] < cell["lru"] - tool.BOUND  # the "kvdb" column holds the policy checked
    assert tool.below(cells) == cells
    assert tool.main(["--variants", "mix", "--seeds", "7", "--fractions", "0.01", "--sessions", "12",
                      "--policy", "lfu"]) == 1


def test_seed_ranges_and_bad_arguments_exit_2_without_a_traceback(capsys):
    tool = load_tool("heldout_sweep")
    assert tool.seed_list("1001-1003,1010") == [1001, 1002, 1003, 1010]
    for bad in (["--seeds", "1006-1001"], ["--variants", "nope"], ["--fractions", "0.0000001", "--seeds", "1"]):
        try:
            code = tool.main([*bad, "--sessions", "4"])
        except SystemExit as e:  # argparse's usage error
            code = e.code
        assert code == 2, bad
        assert "Traceback" not in capsys.readouterr().err
