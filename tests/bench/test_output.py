"""Benchmarks check where their results go before they run: a bad --result-json or --plot cost the run."""

import pytest

from engine.cli import main as driftgate_main


@pytest.mark.parametrize("command", [["bench", "router", "--replicas", "2", "--rounds", "1", "--runs", "1"],
                                     ["cluster-sim", "--nodes", "1", "--load", "0.5", "--num-requests", "2"]])
def test_an_unwritable_result_path_is_exit_2_before_the_run(tmp_path, capsys, command):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for flag, path, message in (("--result-json", tmp_path, "is a folder; give a file name"),
                                ("--result-json", a_file / "r.json", "is a file, not a folder"),
                                ("--plot", a_file / "r.png", "is a file, not a folder")):
        if flag == "--plot" and command[0] == "bench":
            continue  # bench router draws no plot
        assert driftgate_main([*command, flag, str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert a_file.read_text() == "mine"
