"""The model repository's rules that need no model: labels.txt (a version's class names) read as the server reads
it, the versions each model_version_policy aspires to (the repository's transitions under each policy are
tests/unit/test_version_transitions.py), and the versions a config's version labels may name, a rule gunicorn's
master applies without loading TensorFlow."""
import subprocess
import sys

import pytest
from tensorflow_serving.config import model_server_config_pb2

from exported_models.model_format import read_labels
from server_harness import ROOT
from serving.core.policy import aspired_versions
from serving.core.version_labels import check_version_labels


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


def labelled(**labels: int) -> model_server_config_pb2.ModelServerConfig:
    config = model_server_config_pb2.ModelServerConfig()
    config.model_config_list.config.add(name="m", base_path="/m", model_platform="tensorflow").version_labels.update(
        labels)
    return config


def test_a_label_names_an_available_version_unless_allowed_and_an_existing_one_never_moves_to_one_that_is_not():
    check_version_labels(labelled(stable=1), {"m": [1, 2]}, {}, allow_unavailable=False)
    refused = "Request to assign label to version 3 of model m, which is not currently available for inference"
    with pytest.raises(ValueError, match=refused):
        check_version_labels(labelled(stable=1, canary=3), {"m": [1, 2]}, {}, allow_unavailable=False)
    check_version_labels(labelled(canary=3), {"m": [1, 2]}, {}, allow_unavailable=True)  # a new label
    check_version_labels(labelled(canary=3), {"m": [1]}, {"m": {"canary": 3}}, allow_unavailable=True)  # kept
    with pytest.raises(ValueError, match=refused):  # moved from 2: its requests would have nowhere to go
        check_version_labels(labelled(canary=3), {"m": [1, 2]}, {"m": {"canary": 2}}, allow_unavailable=True)


def test_gunicorns_master_checks_labels_and_reads_the_flags_without_loading_tensorflow():
    """serving/core/__init__.py runs before serving.core.version_labels, and looks its names up only when used."""
    probe = ("import sys\nimport serving.process.server, serving.process.flags, serving.core.version_labels\n"
             "print('tensorflow' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_the_cores_namespace_holds_each_name_it_lists():
    import serving.core
    from serving.core import interface

    assert {name: getattr(serving.core, name) for name in serving.core.__all__} == {
        name: getattr(interface, name) for name in serving.core.__all__}
    assert not {name for name in vars(interface) if not name.startswith("_")} - set(serving.core.__all__)
