"""The report says what it lacks: a stage that did not run is named, not silently left out."""

from nanochat import report


def test_report_names_the_stages_that_did_not_run(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    report.reset()
    report.log_section("Base model training", [{"parameters": 10}])
    text = open(report.generate()).read()
    assert ("Not in this report (the stage did not run, or did not finish): Tokenizer training, Tokenizer evaluation, "
            "Base model evaluation, Base model samples, Stage wall times.") in text


def test_the_total_wall_time_is_the_stages_not_the_time_since_the_start(tmp_path, monkeypatch):
    """A report generated long after its run (or after a pause between stages) bills the stages' times only."""
    import json
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    report.reset()
    run = tmp_path / "report" / "run.json"
    run.write_text(json.dumps(dict(json.loads(run.read_text()), start_time=0)))  # started in 1970
    report.log_stage_time("train", 50)
    report.log_stage_time("train", 40, "add")  # a training resumed after a stop adds its time
    report.log_stage_time("eval", 100)
    report.log_stage_time("eval", 30)  # a stage run again (other settings) replaces it
    text = open(report.generate()).read()
    assert "| total wall time | 0.03 h (2.0 min, the stages' sum) |" in text, text
