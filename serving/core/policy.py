"""The version policy (docs/protocols.md, 'Versions'): which of the versions on disk a model config asks to serve."""
from __future__ import annotations

from tensorflow_serving.config.file_system_storage_path_source_pb2 import FileSystemStoragePathSourceConfig


def aspired_versions(policy: FileSystemStoragePathSourceConfig.ServableVersionPolicy,
                     candidates: list[int]) -> set[int]:
    """The versions a FileSystemStoragePathSourceConfig ServableVersionPolicy asks for."""
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return set(candidates)
    if which == "specific":
        return set(candidates) & set(policy.specific.versions)
    count = policy.latest.num_versions if which == "latest" and policy.latest.num_versions > 0 else 1
    return set(sorted(candidates)[-count:])
