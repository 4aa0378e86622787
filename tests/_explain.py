"""The files every ``attnlab explain`` experiment writes, checked the same way by every experiment's tests."""
import json

from attnlab.experiments.explain import QUICK_CONCLUDES
from attnlab.experiments.explain._report import SMOKE


def check_files(result, tmp_path, name):
    """``NAME.png`` / ``.md`` / ``.json`` exist, are what they claim, and agree with ``result``; return the json."""
    for kind, suffix in (("plot", "png"), ("report", "md"), ("json", "json")):
        path = tmp_path / f"{name}.{suffix}"
        assert result["files"][kind] == str(path) and path.stat().st_size > 100
    assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    report = (tmp_path / f"{name}.md").read_text(encoding="utf-8")
    assert report.startswith("# ") and "## What the numbers show" in report and f"![{name}]({name}.png)" in report
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["experiment"] == name and data["quick"] is True and data["findings"] == result["findings"]
    # a quick run concludes only where it reaches the full run's conclusion (QUICK_CONCLUDES); else it is a smoke run
    assert (result["findings"] == [SMOKE]) == (name not in QUICK_CONCLUDES)
    assert (SMOKE in report) == (name not in QUICK_CONCLUDES)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    return data
