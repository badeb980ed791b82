"""The report says what it lacks: a stage that did not run is named, not silently left out."""

from nanochat import report


def test_report_names_the_stages_that_did_not_run(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    report.reset()
    report.log_section("Base model training", [{"parameters": 10}])
    text = open(report.generate()).read()
    assert ("Not in this report (the stage did not run, or did not finish): Tokenizer training, Tokenizer evaluation, "
            "Base model evaluation, Base model samples, Stage wall times.") in text
