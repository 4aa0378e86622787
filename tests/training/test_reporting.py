"""metrics.jsonl survives a torn last line; JSON never holds NaN; the loss plot is a PNG."""
import json
import math

from attnlab.training.reporting import MetricsLog, plot_loss_curve, write_json


def test_metrics_log_truncate_and_torn_line(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.reset()
    for step in (10, 20, 30):
        log.append({"kind": "train", "step": step, "loss": 1.0 / step})
    with open(log.path, "a") as f:
        f.write('{"kind": "train", "st')  # a process killed mid-line
    assert [r["step"] for r in log.records()] == [10, 20, 30]
    kept = log.truncate_after(20)
    assert [r["step"] for r in kept] == [10, 20]
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [10, 20]
    silent = MetricsLog(tmp_path / "other.jsonl", enabled=False)  # ranks > 0 write nothing
    silent.reset()
    silent.append({"step": 1})
    assert not silent.path.exists()


def test_write_json_has_no_nan(tmp_path):
    write_json(tmp_path / "x.json", {"a": float("nan"), "b": [1.5, float("inf")], "c": (1, 2)})
    text = (tmp_path / "x.json").read_text()
    assert json.loads(text) == {"a": None, "b": [1.5, None], "c": [1, 2]}
    assert "NaN" not in text and "Infinity" not in text


def test_loss_plot(tmp_path):
    recs = [{"kind": "train", "step": s, "loss": 4 / math.sqrt(s)} for s in range(1, 50)]
    recs += [{"kind": "eval", "step": s, "val_loss": 4.2 / math.sqrt(s)} for s in (10, 20, 49)]
    plot_loss_curve(recs, tmp_path / "loss.png", title="t")
    plot_loss_curve([], tmp_path / "empty.png")
    for name in ("loss.png", "empty.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
