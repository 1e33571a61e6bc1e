"""The model zoo: the recipe's CNN layer for layer, the compact default, the keras.applications backbones."""
import keras
import numpy as np
import pytest
from keras import layers

from training.models import MODEL_NAMES, ModelConfig, build_model, fed_transposed

SIZE = 32


def _images(n=3, size=SIZE):
    return np.random.default_rng(0).uniform(-1, 1, (n, size, size, 3)).astype("float32")


def test_cnn_matches_the_recipe_layer_for_layer():
    model = build_model("cnn", 5, SIZE)
    body = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    summary = [(type(layer).__name__, getattr(layer, "filters", None) or getattr(layer, "units", None))
               for layer in body]
    assert summary == [("Conv2D", 10), ("MaxPooling2D", None), ("Conv2D", 20), ("MaxPooling2D", None),
                       ("Flatten", None), ("Dense", 300), ("Dropout", None), ("Dense", 5)]
    conv1, conv2 = body[0], body[2]
    assert conv1.kernel_size == conv2.kernel_size == (5, 5)
    assert conv1.activation is keras.activations.relu and body[5].activation is keras.activations.relu
    assert body[1].pool_size == body[3].pool_size == (2, 2)
    assert body[6].rate == 0.25
    quarter = SIZE // 4
    assert model.count_params() == (5 * 5 * 3 * 10 + 10) + (5 * 5 * 10 * 20 + 20) + (
        quarter * quarter * 20 * 300 + 300) + (300 * 5 + 5)


def test_cnn_batch_norm_goes_on_the_dense_layer():
    model = build_model("cnn", 5, SIZE, batch_norm=True)
    names = [type(layer).__name__ for layer in model.layers]
    dense = names.index("Dense")
    assert names[dense:dense + 4] == ["Dense", "BatchNormalization", "Activation", "Dropout"]
    assert names.count("BatchNormalization") == 1


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_returns_float32_logits(name):
    model = build_model(name, 5, SIZE)
    logits = model(_images(), training=False)
    assert logits.shape == (3, 5) and logits.dtype == "float32"
    assert np.isfinite(np.asarray(logits)).all()


def test_logits_stay_float32_under_bf16_mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = build_model("compact", 5, SIZE)
        assert model.get_layer("block1_conv").compute_dtype == "bfloat16"
        assert model(_images()).dtype == "float32"
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_compact_is_small_enough_to_ship():
    model = build_model("compact", 5, 96)
    assert model.count_params() * 4 < 1_000_000
    assert any(isinstance(layer, layers.GlobalAveragePooling2D) for layer in model.layers)
    assert build_model("compact", 5, 32).count_params() == model.count_params()


def test_transposed_input_gives_the_same_logits():
    plain = build_model("compact", 5, SIZE)
    transposed = fed_transposed(plain)
    images = _images(4)
    hwcn = np.transpose(images, [1, 2, 3, 0])
    assert transposed.input_shape == (SIZE, SIZE, 3, None)
    np.testing.assert_allclose(transposed(hwcn), plain(images), rtol=1e-5, atol=1e-5)


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model 'vgg'.*compact"):
        build_model("vgg", 5, SIZE)


def test_model_config_round_trips_through_its_directory(tmp_path):
    config = ModelConfig("cnn", ("a", "b", "c"), 48, batch_norm=True)
    config.save(str(tmp_path))
    loaded = ModelConfig.load(str(tmp_path))
    assert loaded == config
    assert loaded.build().output_shape == (None, 3)
    with pytest.raises(FileNotFoundError, match="petal train"):
        ModelConfig.load(str(tmp_path / "missing"))
