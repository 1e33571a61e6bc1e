"""SavedModels that Petal did not write, loaded in process as Servables (tests/foreign_models.py and
exported_models/tf_serving_models.py build them): a TF1 graph's meta graph chosen by its tags, a model.tflite without
signatures given TF Serving's generated one, and a TF2 module's signatures called flat (serving/core/loaders.py).
The same models served by `petal serve` are
tests/e2e/test_foreign_loading.py."""
from __future__ import annotations

import numpy as np
import pytest

import foreign_models
from exported_models import model_format, tf_serving_models
from serving.core import Code, ServingError
from serving.core.loaders import LoadOptions
from serving.core.servable import Servable


def test_saved_model_tags_are_comma_separated_and_must_match_a_meta_graph(tmp_path):
    assert LoadOptions.from_flags("serve, gpu,,", False).tags == {"serve", "gpu"}
    assert LoadOptions.from_flags("", True) == LoadOptions(frozenset({"serve"}), True)
    version = tf_serving_models.half_plus_two(str(tmp_path / "1"))
    refused = r"no meta graph with tags \['gpu', 'serve'\]; the SavedModel has \[\['serve'\]\]"
    with pytest.raises(ValueError, match=refused):
        Servable("m", 1, version, LoadOptions.from_flags("serve,gpu", False))
    servable = Servable("m", 1, version, LoadOptions.from_flags("serve", False))
    assert (servable.format, servable.static_shapes) == ("saved_model_session", False)
    x = np.array([1.0, 2.0], np.float32)  # x:0 is [-1, 1]: fed by name, a value of any shape replaces it
    assert servable.run("serving_default", {"x": x})["y"].tolist() == [2.5, 3.0]


def test_a_tflite_file_without_signatures_gets_tf_servings_generated_one(tmp_path):
    from tensorflow.lite.tools import flatbuffer_utils

    version = foreign_models.tf2_module(str(tmp_path))
    model = flatbuffer_utils.read_model(foreign_models.tflite_beside(version))
    model.signatureDefs = []  # as older converters wrote them
    flatbuffer_utils.write_model(model, f"{version}/{model_format.TFLITE_FILE}")
    servable = Servable("m", 1, version, LoadOptions(prefer_tflite=True))
    assert list(servable.signatures) == ["serving_default"] and servable.format == "tflite"
    info = servable.signatures["serving_default"]
    assert list(info.inputs) == ["serving_default_x"]  # the key without ":0", the tensor name with it
    assert info.inputs["serving_default_x"].name == "serving_default_x:0"
    (output,) = info.outputs
    for x in ([1.0, 2.0, 5.0], [4.0]):
        got = servable.run("serving_default", {"serving_default_x": np.array(x, np.float32)})
        assert got[output].tolist() == [0.5 * v + 2 for v in x]


def test_a_tf2_signature_called_flat_maps_inputs_and_outputs_by_name_and_refuses_bad_input(tmp_path):
    servable = Servable("m", 1, foreign_models.tf2_module(str(tmp_path)), LoadOptions())
    assert servable.format == "saved_model_tf2"
    inputs = {"text": np.array([b"abc", b""], dtype=object), "ids": np.array([[1, 2], [3, 4]], np.int64)}
    got = servable.run("multi", inputs)  # two inputs, three outputs: the flat orders are not the given ones
    assert {k: v.tolist() for k, v in got.items()} == {"sum": [3, 7], "length": [3, 0], "echo_bytes": [b"abc", b""]}
    for bad in ({"ids": inputs["ids"]}, {**inputs, "extra": inputs["ids"]}):
        with pytest.raises(ServingError) as refused:
            servable.run("multi", bad)
        assert refused.value.code == Code.INVALID_ARGUMENT and "['ids', 'text']" in refused.value.message
    with pytest.raises(ServingError) as wrong_dtype:  # int32 for an int64 input: TensorFlow's own refusal
        servable.run("multi", {**inputs, "ids": inputs["ids"].astype(np.int32)})
    assert wrong_dtype.value.code == Code.INVALID_ARGUMENT and "int64" in wrong_dtype.value.message
