"""SavedModels that Petal did not write, loaded in process as Servables (tests/foreign_models.py and
exported_models/tf_serving_models.py build them): a TF1 graph's meta graph chosen by its tags, a model.tflite without
signatures given TF Serving's generated one, a TF2 module in a Session and its signatures called flat, and Keras's own
export, which only runs as functions (serving/core/runtimes.py).
The same models served by `petal serve` are
tests/e2e/test_foreign_loading.py."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import tensorflow as tf

import foreign_models
from exported_models import model_format, tf_serving_models
from serving.core import Code, ServingError, runtimes
from serving.core.runtimes import LoadOptions
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


MULTI_INPUTS = {"text": np.array([b"abc", b""], dtype=object), "ids": np.array([[1, 2], [3, 4]], np.int64)}
MULTI_OUTPUTS = {"sum": [3, 7], "length": [3, 0], "echo_bytes": [b"abc", b""]}


def test_a_tf2_signature_called_flat_maps_inputs_and_outputs_by_name_and_refuses_bad_input(tmp_path):
    path = foreign_models.tf2_module(str(tmp_path))
    model = runtimes.FunctionModel(path, model_format.meta_graph(model_format.read_saved_model(path), {"serve"}),
                                  frozenset({"serve"}))
    run = functools.partial(model.run, "multi", output_names=["sum", "length", "echo_bytes"])
    got = run(MULTI_INPUTS)  # two inputs, three outputs: the flat orders are not the given ones
    assert {k: v.tolist() for k, v in got.items()} == MULTI_OUTPUTS
    for bad in ({"ids": MULTI_INPUTS["ids"]}, {**MULTI_INPUTS, "extra": MULTI_INPUTS["ids"]}):
        with pytest.raises(ServingError) as refused:
            run(bad)
        assert refused.value.code == Code.INVALID_ARGUMENT and "['ids', 'text']" in refused.value.message
    with pytest.raises(ServingError) as wrong_dtype:  # int32 for an int64 input: TensorFlow's own refusal
        run({**MULTI_INPUTS, "ids": MULTI_INPUTS["ids"].astype(np.int32)})
    assert wrong_dtype.value.code == Code.INVALID_ARGUMENT and "int64" in wrong_dtype.value.message


def test_a_tf2_module_runs_in_a_session_as_tf_serving_runs_it_with_the_functions_answers(tmp_path):
    path = foreign_models.tf2_module(str(tmp_path))
    servable = Servable("m", 1, path, LoadOptions())
    assert (servable.format, servable.static_shapes) == ("saved_model_tf2_session", True)  # TF2's shape contract
    assert {k: v.tolist() for k, v in servable.run("multi", MULTI_INPUTS).items()} == MULTI_OUTPUTS
    functions = tf.saved_model.load(path).signatures
    examples = np.array([foreign_models.example(x=x).SerializeToString() for x in (1.0, 6.0)], dtype=object)
    for key, value in (("serving_default", np.array([1.0, 6.0], np.float32)), ("classify", examples),
                       ("regress", examples)):
        (name,) = servable.signatures[key].inputs
        want = {k: v.numpy().tolist() for k, v in functions[key](**{name: tf.constant(value)}).items()}
        assert {k: v.tolist() for k, v in servable.run(key, {name: value}).items()} == want, key


def test_a_keras_export_whose_graph_restores_copies_of_its_variables_runs_as_functions(tmp_path):
    """Keras 3's own `model.export()` checkpoints copies of the variables, so its graph in a Session (TF Serving's
    SavedModelBundle) reads variables nothing restored (keras-team/keras#20096): it runs as functions."""
    servable = Servable("m", 1, foreign_models.keras_export(str(tmp_path)), LoadOptions())
    assert (servable.format, servable.static_shapes) == ("saved_model_tf2", True)
    key = "serving_default"
    (name,) = servable.signatures[key].outputs
    got = servable.run(key, {"features": np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 2.0]], np.float32)})
    np.testing.assert_allclose(got[name], [[6.5], [6.5]])
