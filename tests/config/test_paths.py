

def test_a_metrics_file_must_be_a_file_that_can_be_written(tmp_path):
    import pytest

    from tierkv.config import ConfigError, load_config

    for value, problem in ((str(tmp_path), "it is a directory"), ("/proc/nope/x.jsonl", "pseudo file system"),
                           (str(tmp_path / "a-file" / "x.jsonl"), "is not one")):
        (tmp_path / "a-file").write_text("")
        with pytest.raises(ConfigError, match=f"metrics.jsonl_path': got '{value}'.*{problem}"):
            load_config({"metrics": {"jsonl_path": value}}, env={})
    assert load_config({"metrics": {"jsonl_path": str(tmp_path / "new" / "x.jsonl")}}, env={})


def test_a_metrics_file_under_home_is_written_there(tmp_path, monkeypatch):
    from tierkv.metrics.recorder import MetricsRecorder

    monkeypatch.setenv("HOME", str(tmp_path))
    recorder = MetricsRecorder(lambda: {"x": 1}, jsonl_path="~/runs/x.jsonl")
    assert recorder.jsonl_path == tmp_path / "runs" / "x.jsonl"
