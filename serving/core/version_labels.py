"""The repository's rule for the labels that name versions, TF Serving's, which reads no file and loads nothing.

A module of its own, importing neither TensorFlow nor the rest of the core, so that gunicorn's master checks the
first config's labels (serving/process/flags.py) with the same rule the repository applies to every reload
(serving/core/repository.py), without loading TensorFlow (serving/core/__init__.py loads it only when its names are
used).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

from tensorflow_serving.config import model_server_config_pb2


def check_version_labels(config: model_server_config_pb2.ModelServerConfig, available: Mapping[str, Collection[int]],
                         labels: Mapping[str, Mapping[str, int]], allow_unavailable: bool) -> None:
    """TF Serving's rule for `version_labels` (ServerCore::UpdateModelVersionLabelMap, model_servers/server_core.cc):
    a label names a version AVAILABLE when the config is taken (`available`, by model), so that a label never sends
    requests to a version that cannot answer them. With --allow_version_labels_for_unavailable_models a label new to
    the model, or one naming the version it names now (`labels`, by model), may name any version; an existing label
    is still never moved to one, so that a version swap does not drop the label's requests while the new version
    loads. ValueError, in TF Serving's words, names the first label refused: its FAILED_PRECONDITION."""
    for model in config.model_config_list.config:
        current = labels.get(model.name, {})
        for label, version in model.version_labels.items():
            if allow_unavailable and current.get(label, version) == version:
                continue
            if version not in available.get(model.name, ()):
                raise ValueError(f"Request to assign label to version {version} of model {model.name}, which is not "
                                 "currently available for inference")
