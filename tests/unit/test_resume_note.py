"""A resumed run keeps its own arguments (engine/train/state/resume_state.py): keys given that it does not take are
named in one line and an event, so a different batch (and so a different learning-rate recipe) is never silent."""

from __future__ import annotations


def test_a_resumed_run_says_which_given_keys_it_does_not_take(tmp_path, capsys) -> None:
    """batch=512 given to a run that was planned at 16: the run goes on at 16 (its recipe too), in one line and an
    event; launch keys (device, workers) and keys at their defaults are not named."""
    import json

    from detrain.config.cfg import make_cfg
    from detrain.engine.train.state import resume_state

    recorded = make_cfg({"batch": 16, "epochs": 10}).to_dict()
    given = make_cfg({"batch": 512, "epochs": 10, "device": "cpu", "workers": 1, "resume": "x.pt"})
    resume_state._say_ignored(given, recorded, tmp_path)
    line = capsys.readouterr().out.replace("\n", " ")
    assert "not taken: batch=512 (kept: 16);" in line and "device" not in line and "workers" not in line
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["keys"]) for e in events] == [("resume_ignored", ["batch"])]
    resume_state._say_ignored(make_cfg({"batch": 16, "resume": "x.pt"}), recorded, tmp_path / "quiet")
    assert capsys.readouterr().out == "" and not (tmp_path / "quiet").exists()
