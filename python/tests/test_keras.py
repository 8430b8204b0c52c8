"""`from_keras` on the Keras guide's convnet, its `get_model()` as the guide writes it:
trained by `fit` from the model's own weights on 2 devices, the trained weights put back
with `set_weights`, and Keras's accuracy on them equal to lockstep's on the same held-out
images. Keras runs on its torch backend; skipped where keras is not installed."""

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip("keras")
import lockstep  # noqa: E402


def get_model():
    # Make a simple convnet with batch normalization and dropout.
    inputs = keras.Input(shape=(28, 28, 1))
    x = keras.layers.Rescaling(1.0 / 255.0)(inputs)
    x = keras.layers.Conv2D(filters=12, kernel_size=3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters=24, kernel_size=6, use_bias=False, strides=2)(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters=32, kernel_size=6, padding="same", strides=2, name="large_k")(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(256, activation="relu")(x)
    x = keras.layers.Dropout(0.5)(x)
    outputs = keras.layers.Dense(10)(x)
    model = keras.Model(inputs, outputs)
    return model


def learnable_images(n, seed):
    """n 28×28×1 uint8 images (Keras's layout) whose class (of 4) is which halves are brighter."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, 28, 28, 1), dtype=np.uint8)
    top = x[:, :14, :, 0].mean((1, 2)) > x[:, 14:, :, 0].mean((1, 2))
    left = x[:, :, :14, 0].mean((1, 2)) > x[:, :, 14:, 0].mean((1, 2))
    return x, top.astype(np.int64) + 2 * left


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:2"])
def test_the_keras_guides_convnet_trains_and_its_weights_go_back(devices):
    keras.utils.set_random_seed(0)
    model = get_model()
    x, y = learnable_images(384, 1)
    xv, yv = x[:96], y[:96]
    converted = lockstep.from_keras(model)
    assert converted.spec["input_shape"] == [1, 28, 28]
    before = [w.copy() for w in model.get_weights()]
    h = lockstep.fit(converted, x, y, validation_data=(xv, yv), epochs=2, batch_size=48, devices=devices, verbose=False)
    assert h.stopped == "completed"
    h.load_into(model)
    after = model.get_weights()
    assert [w.shape for w in after] == [w.shape for w in before]
    assert any(not np.array_equal(a, b) for a, b in zip(after, before)), "nothing trained"
    predicted = np.asarray(model.predict(xv.astype(np.float32), verbose=0)).argmax(1)
    assert (predicted == yv).mean() == h.history["val_accuracy"][-1]


def test_the_weights_go_across_and_back_unchanged():
    model = get_model()
    converted = lockstep.from_keras(model)
    from lockstep import History

    h = History.__new__(History)
    h._model, h.weights = converted, converted.weights
    before = [w.copy() for w in model.get_weights()]
    h.load_into(model)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))


def test_a_layer_without_a_counterpart_is_named():
    inputs = keras.Input(shape=(8,))
    outputs = keras.layers.Dense(4)(keras.layers.GaussianNoise(0.1)(inputs))
    with pytest.raises(ValueError, match=r"layer gaussian_noise \(GaussianNoise\) has no lockstep counterpart"):
        lockstep.from_keras(keras.Model(inputs, outputs))
