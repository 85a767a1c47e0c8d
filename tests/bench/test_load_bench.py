"""`driftgate bench load` on the tiny model: fresh processes, their memory and seconds, medians."""

import json
import shutil
import statistics

from engine.cli import main as driftgate_main


def test_bench_load_measures_each_load_in_a_fresh_process(tiny_model_dir, tmp_path):
    out = tmp_path / "load.json"
    rc = driftgate_main(["bench", "load", f"tiny={tiny_model_dir}@bfloat16", "--runs", "2",
                         "--result-json", str(out), "--plot", str(tmp_path / "load.png")])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [(r["name"], r["dtype"]) for r in result["rows"]] == [("tiny", "bfloat16")]
    for row in result["rows"]:
        assert len(row["runs"]) == 2 and row["load_s"] == statistics.median(r["load_s"] for r in row["runs"])
        for run in row["runs"]:  # a process's high-water marks are at least what it holds after
            assert 0 < run["anon_before_mib"] <= run["anon_peak_mib"] and run["anon_after_mib"] <= run["anon_peak_mib"]
            assert run["rss_after_mib"] <= run["peak_rss_mib"] and run["load_s"] > 0
    assert (tmp_path / "load.png").stat().st_size > 0


def test_a_checkpoint_that_fails_to_load_is_named_with_the_reason(tiny_model_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    assert driftgate_main(["bench", "load", f"broken={broken}", "--runs", "1"]) == 2
    err = capsys.readouterr().err
    assert "broken: loading" in err and "cannot read" in err
