"""The files every ``attnlab explain`` experiment writes, checked the same way by every experiment's tests."""
import json


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
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    return data
