"""The eval history a resumed run reads (eval_results.jsonl) is replaced whole or not at all: a kill while it was
rewritten in place left it empty, and the resume then kept only the evals after it."""
import pytest
import tensorflow as tf

from training.train import write_whole


def test_a_write_cut_short_leaves_the_old_history(tmp_path, monkeypatch):
    path = tmp_path / "eval_results.jsonl"
    path.write_text('{"step": 5}\n{"step": 10}\n')

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the rename")
    monkeypatch.setattr(tf.io.gfile, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        write_whole(str(path), '{"step": 5}\n{"step": 10}\n{"step": 15}\n')
    assert path.read_text() == '{"step": 5}\n{"step": 10}\n'


def test_the_new_history_replaces_the_old_one(tmp_path):
    path = tmp_path / "eval_results.jsonl"
    path.write_text('{"step": 5}\n')
    write_whole(str(path), '{"step": 5}\n{"step": 10}\n')
    assert path.read_text() == '{"step": 5}\n{"step": 10}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["eval_results.jsonl"]
