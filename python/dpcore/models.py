"""Models: sequential networks whose parameters live in one flat buffer in C.

``LeNet()`` is the network of *Dive into Deep Learning* 12.5. Parameter names
follow PyTorch's ``state_dict`` names for the equivalent ``torch.nn.Sequential``
(``'0.weight'``, ``'0.bias'``, ``'3.weight'``, ...), so weights move between the
two libraries with ``get_weights`` / ``set_weights``.
"""
from collections import OrderedDict, namedtuple

import numpy as np

from . import _core
from .batches import as_images, as_labels

__all__ = ["Sequential", "LeNet", "Metrics"]

Metrics = namedtuple("Metrics", ["loss", "accuracy", "num_examples"])


class Sequential:
    """A feed-forward network built from layer specs, trained by the C core.

    layers: list of tuples, each one of
        ('conv2d', out_channels, kernel, stride, padding), ('dense', out_features),
        ('relu',), ('avgpool', kernel, stride, padding), ('maxpool', kernel, stride, padding),
        ('flatten',).
    Weights are drawn from N(0, init_std) and biases are 0 (the book's init).
    """

    def __init__(self, layers, input_shape=(1, 28, 28), init_std=0.01, seed=0, threads=0):
        self._specs = [tuple(spec) for spec in layers]
        self._model = _core.Model(tuple(input_shape), self._specs, threads)
        self._layout = self._model.param_layout()
        rng = np.random.default_rng(seed)
        flat = np.zeros(self._model.nparams, dtype=np.float32)
        for _, kind, offset, shape in self._layout:
            if kind == "weight":
                size = int(np.prod(shape))
                flat[offset:offset + size] = rng.normal(0.0, init_std, size).astype(np.float32)
        self._model.set_params(flat)

    # ---- description -------------------------------------------------------
    @property
    def input_shape(self):
        return self._model.input_shape

    @property
    def num_classes(self):
        return self._model.num_classes

    @property
    def num_params(self):
        """Number of trainable scalars (the flat buffer also holds alignment padding)."""
        return int(sum(np.prod(shape) for _, _, _, shape in self._layout))

    @property
    def devices(self):
        return [self._model.device]

    def parameter_names(self):
        return [f"{layer}.{kind}" for layer, kind, _, _ in self._layout]

    def summary(self):
        """A table of layers and output shapes, as a string."""
        lines = [f"{'#':>3}  {'layer':<8} {'output shape':<16} params"]
        counts = {}
        for layer, _, _, shape in self._layout:
            counts[layer] = counts.get(layer, 0) + int(np.prod(shape))
        for i, (kind, _, out) in enumerate(self._model.layers()):
            shape = (out[0],) if out[1:] == (1, 1) else out
            lines.append(f"{i:>3}  {kind:<8} {str(shape):<16} {counts.get(i, 0)}")
        lines.append(f"total parameters: {self.num_params}")
        return "\n".join(lines)

    def __repr__(self):
        return f"{type(self).__name__}(params={self.num_params}, devices={self.devices})"

    # ---- weights -----------------------------------------------------------
    def get_weights(self):
        """An OrderedDict name -> float32 array (copies), PyTorch state_dict names."""
        flat = self._model.get_params()
        out = OrderedDict()
        for layer, kind, offset, shape in self._layout:
            size = int(np.prod(shape))
            out[f"{layer}.{kind}"] = flat[offset:offset + size].reshape(shape).copy()
        return out

    def set_weights(self, weights):
        """Load weights from a dict name -> array (every name, exact shapes) or a list in order."""
        names = self.parameter_names()
        if isinstance(weights, dict):
            missing = [n for n in names if n not in weights]
            extra = [n for n in weights if n not in names]
            if missing or extra:
                raise KeyError(f"weights do not match the model: missing {missing}, unexpected {extra}")
            values = [weights[n] for n in names]
        else:
            values = list(weights)
            if len(values) != len(names):
                raise ValueError(f"expected {len(names)} arrays ({', '.join(names)}), got {len(values)}")
        flat = self._model.get_params()
        for (layer, kind, offset, shape), name, value in zip(self._layout, names, values):
            a = np.asarray(value)
            if a.dtype.kind not in "fiu":
                raise TypeError(f"{name}: expected a real array, got dtype {a.dtype}")
            if tuple(a.shape) != tuple(shape):
                raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
            flat[offset:offset + a.size] = a.astype(np.float32).ravel()
        self._model.set_params(flat)

    # ---- running -----------------------------------------------------------
    def _batches(self, data, batch_size):
        """(images, labels|None) batches from an iterator of (X, y) or from an array X."""
        if isinstance(data, np.ndarray):
            X = as_images(data, self.input_shape)
            for i in range(0, len(X), batch_size):
                yield X[i:i + batch_size], None
        else:
            for batch in data:
                if not (isinstance(batch, tuple) and len(batch) == 2):
                    raise TypeError("a data iterator must yield (images, labels) pairs")
                X, y = batch
                yield as_images(X, self.input_shape), as_labels(y, len(X))

    def predict(self, X, batch_size=1024):
        """Logits (N, num_classes) as float32 for images (N, C, H, W) or (N, H, W)."""
        X = as_images(X, self.input_shape)
        if len(X) == 0:
            return np.zeros((0, self.num_classes), dtype=np.float32)
        return np.concatenate([self._model.predict(X[i:i + batch_size]) for i in range(0, len(X), batch_size)])

    def evaluate(self, data_iter):
        """Mean loss and accuracy over a dataset iterator: Metrics(loss, accuracy, num_examples)."""
        loss, correct, n = 0.0, 0, 0
        for X, y in self._batches(data_iter, 1024):
            if y is None:
                raise TypeError("evaluate needs labels: pass an iterator of (images, labels)")
            batch_loss, batch_correct = self._model.evaluate(X, y)
            loss += batch_loss
            correct += batch_correct
            n += len(y)
        if n == 0:
            raise ValueError("evaluate: the dataset is empty")
        return Metrics(loss / n, correct / n, n)

    def train_step(self, X, y, lr, momentum=0.0, weight_decay=0.0):
        """One SGD step on a batch (mean loss). Returns (loss_sum, correct)."""
        X = as_images(X, self.input_shape)
        return self._model.train_step(X, as_labels(y, len(X)), lr, momentum, weight_decay)


class LeNet(Sequential):
    """The LeNet of *Dive into Deep Learning* 12.5 for 28x28 images.

    conv 3x3 in->20, ReLU, avg-pool 2; conv 5x5 20->50, ReLU, avg-pool 2;
    flatten; dense 800->128, ReLU; dense 128->num_classes. Weights N(0, 0.01),
    biases 0 (``seed`` fixes the draw). Layer indices match
    ``torch.nn.Sequential(Conv2d, ReLU, AvgPool2d, Conv2d, ReLU, AvgPool2d,
    Flatten, Linear, ReLU, Linear)``, so the weights are named like its state_dict.
    """

    def __init__(self, num_classes=10, in_channels=1, seed=0, threads=0):
        layers = [
            ("conv2d", 20, 3, 1, 0), ("relu",), ("avgpool", 2, 2, 0),
            ("conv2d", 50, 5, 1, 0), ("relu",), ("avgpool", 2, 2, 0),
            ("flatten",), ("dense", 128), ("relu",), ("dense", num_classes),
        ]
        super().__init__(layers, input_shape=(in_channels, 28, 28), init_std=0.01, seed=seed, threads=threads)
