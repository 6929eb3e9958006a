"""OCI images for the local backend: pull, verify, store once, unpack for overlayfs.

Plain Python (no Django), like the rest of the local backend. See docs/images.md.
"""

from .egress import RegistryPolicy
from .errors import (
    DigestMismatch,
    DiskExhausted,
    ImageError,
    ImageNotFound,
    ImageStoreError,
    InvalidArchive,
    InvalidReference,
    LayerRefused,
    RegistryForbidden,
    RegistryUnauthorized,
    RegistryUnreachable,
    UnsupportedPlatform,
)
from .reference import Reference, parse
from .skopeo import Credentials
from .store import ImageConfig, ImageRecord, ImageStore, LayerInfo
from .user import ImageUserUnknown, resolve_user

__all__ = [
    "Credentials",
    "DigestMismatch",
    "DiskExhausted",
    "ImageConfig",
    "ImageError",
    "ImageNotFound",
    "ImageRecord",
    "ImageStore",
    "ImageStoreError",
    "ImageUserUnknown",
    "InvalidArchive",
    "InvalidReference",
    "LayerInfo",
    "LayerRefused",
    "Reference",
    "RegistryForbidden",
    "RegistryPolicy",
    "RegistryUnauthorized",
    "RegistryUnreachable",
    "UnsupportedPlatform",
    "parse",
    "resolve_user",
]
