"""The model repository's rules that need no model: labels.txt (a version's class names) read as the server reads
it, and the versions each model_version_policy aspires to (the repository's transitions under each policy are
tests/unit/test_version_transitions.py)."""
import pytest
from tensorflow_serving.config import model_server_config_pb2

from exported_models.model_format import read_labels
from serving.core.policy import aspired_versions


def test_read_labels_skips_blank_lines_and_rejects_bad_files(tmp_path):
    path = tmp_path / "labels.txt"
    path.write_text("daisy\n\n roses \r\ntulips")
    assert read_labels(str(path)) == ["daisy", "roses", "tulips"]
    path.write_text("daisy\nroses\ndaisy\n")
    with pytest.raises(ValueError, match="twice"):
        read_labels(str(path))
    path.write_text("\n")
    with pytest.raises(ValueError, match="no labels"):
        read_labels(str(path))
    with pytest.raises(FileNotFoundError):
        read_labels(str(tmp_path / "missing.txt"))


def test_policies():
    policy = model_server_config_pb2.ModelConfig().model_version_policy
    assert aspired_versions(policy, [1, 2, 3]) == {3}
    policy.latest.num_versions = 2
    assert aspired_versions(policy, [1, 2, 3]) == {2, 3}
    policy.specific.versions.extend([1, 5])
    assert aspired_versions(policy, [1, 2, 3]) == {1}
    policy.all.SetInParent()
    assert aspired_versions(policy, [1, 2, 3]) == {1, 2, 3}
