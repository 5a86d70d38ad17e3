"""scikit-learn's bundled data sets: small, offline, the embedded default for demos and tests."""

from __future__ import annotations

import numpy as np
import torch

from initlab.data.dataset import Dataset

__all__ = ["SKLEARN_SETS", "load_sklearn"]

#: Bundled scikit-learn sets: name -> (loader function in ``sklearn.datasets``, display name).
SKLEARN_SETS = {
    "digits": ("load_digits", "digits (scikit-learn)"),
    "iris": ("load_iris", "iris (scikit-learn)"),
    "wine": ("load_wine", "wine (scikit-learn)"),
    "breast_cancer": ("load_breast_cancer", "breast cancer (scikit-learn)"),
}


def load_sklearn(name: str) -> Dataset:
    """One of scikit-learn's bundled sets (:data:`SKLEARN_SETS`), features as stored (unscaled).

    These sets have no train/test split; the whole set is returned with ``split=None``.
    :attr:`Dataset.label_map` holds the class names (``0 .. 9`` for digits).
    """
    if name not in SKLEARN_SETS:
        raise ValueError(f"unknown scikit-learn set {name!r}; choose from {sorted(SKLEARN_SETS)}")
    try:
        from sklearn import datasets
    except ImportError as err:
        raise ImportError(
            f"the {name!r} data set ships with scikit-learn: `pip install scikit-learn` (or "
            "`pip install 'initlab[demo]'`)"
        ) from err
    function, display = SKLEARN_SETS[name]
    bunch = getattr(datasets, function)()
    x = torch.from_numpy(np.ascontiguousarray(bunch.data, dtype=np.float32))
    names = tuple(n.item() if isinstance(n, np.generic) else n for n in bunch.target_names)
    return Dataset(
        x=x,
        y=torch.from_numpy(np.asarray(bunch.target, dtype=np.int64)),
        name=display,
        n_features=x.shape[1],
        n_classes=len(names),
        label_map=names,
    )
