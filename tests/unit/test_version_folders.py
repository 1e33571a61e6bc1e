"""Version discovery without a server, as TF Serving finds versions: zero-padded and plain folders, TFLite-only
versions, and colliding names (the versions served from such folders are tests/e2e/test_foreign_loading.py)."""
from __future__ import annotations

import logging
import os

import pytest

from exported_models import model_format


def touch_version(base, name: str) -> None:
    os.makedirs(base / name)
    (base / name / model_format.SAVED_MODEL_FILE).write_bytes(b"")


def test_padded_and_plain_folders_are_versions_at_the_path_found(tmp_path):
    for name in ("00000123", "7", "0", "12a", "-3", "+4", "٣", ".tmp-9-abc"):
        touch_version(tmp_path, name)
    os.makedirs(tmp_path / "99")  # no saved_model.pb yet: still being copied
    (tmp_path / "55").mkdir()
    (tmp_path / "55" / model_format.TFLITE_FILE).write_bytes(b"")  # a TFLite-only version, as TF Serving ships
    found = model_format.version_dirs(str(tmp_path))
    assert found == {0: f"{tmp_path}/0", 7: f"{tmp_path}/7", 55: f"{tmp_path}/55", 123: f"{tmp_path}/00000123"}
    assert model_format.exported_versions(str(tmp_path)) == [0, 7, 55, 123]
    assert model_format.latest_version(str(tmp_path)) == f"{tmp_path}/00000123"
    assert model_format.next_version(str(tmp_path)) == 124


def test_colliding_folders_pick_the_name_sorting_last_and_say_so(tmp_path, caplog):
    for name in ("007", "7", "0007", "00000008"):
        touch_version(tmp_path, name)
    with caplog.at_level(logging.WARNING, logger="exported_models.model_format"):
        assert model_format.version_dirs(str(tmp_path)) == {7: f"{tmp_path}/7", 8: f"{tmp_path}/00000008"}
        model_format.version_dirs(str(tmp_path))  # the source polls every second: the warning is not repeated
    warnings = [r for r in caplog.records if r.getMessage() == "duplicate version folders"]
    assert [(r.fields["version"], r.fields["loaded_from"], r.fields["ignored"]) for r in warnings] == [
        (7, "7", ["0007", "007"])]
    assert model_format.latest_version(str(tmp_path)) == f"{tmp_path}/00000008"


def test_a_folder_without_a_model_is_no_version_and_latest_version_says_so(tmp_path):
    touch_version(tmp_path, "3")
    os.makedirs(tmp_path / "7")  # no saved_model.pb yet: still being copied
    os.makedirs(tmp_path / "tmp")
    assert model_format.exported_versions(str(tmp_path)) == [3]
    assert model_format.latest_version(str(tmp_path / "3")) == str(tmp_path / "3"), "a version folder as it is"
    assert model_format.exported_versions(str(tmp_path / "missing")) == []
    with pytest.raises(FileNotFoundError, match="no SavedModel"):
        model_format.latest_version(str(tmp_path / "7"))


def test_a_folder_holding_saved_model_pbtxt_is_a_version_read_as_text(tmp_path):
    """TensorFlow's loader (MaybeSavedModelDirectory, ReadSavedModel), which TF Serving's calls, takes the
    SavedModel as text where there is no saved_model.pb; the binary file wins where there are both."""
    os.makedirs(tmp_path / "3")
    (tmp_path / "3" / "saved_model.pbtxt").write_text('saved_model_schema_version: 1 meta_graphs { '
                                                      'meta_info_def { tags: "serve" } }')
    assert model_format.version_dirs(str(tmp_path)) == {3: f"{tmp_path}/3"}
    assert model_format.latest_version(str(tmp_path / "3")) == f"{tmp_path}/3"
    assert list(model_format.read_saved_model(f"{tmp_path}/3").meta_graphs[0].meta_info_def.tags) == ["serve"]
    (tmp_path / "3" / model_format.SAVED_MODEL_FILE).write_bytes(b"")
    assert not model_format.read_saved_model(f"{tmp_path}/3").meta_graphs
