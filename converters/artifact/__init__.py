"""An artifact's files: names and layout (torch-free: the service imports them), atomic writes, the manifest
and its check.
"""

from converters._lazy import lazy_exports

#: public name -> the module that defines it (loaded on first use: see converters._lazy)
_EXPORTS = {
    "FP8_BLOCK_VERSION": "converters.artifact.layout",
    "STATE_FILE": "converters.artifact.layout",
    "CALIBRATION_FILE": "converters.artifact.layout",
    "REPORT_FILE": "converters.artifact.layout",
    "MANIFEST_NAME": "converters.artifact.layout",
    "staging_dir_for": "converters.artifact.layout",
    "sha256_file": "converters.artifact.layout",
    "read_fp8_block": "converters.artifact.layout",
    "write_json": "converters.artifact.files",
    "save_tensors": "converters.artifact.files",
    "write_manifest": "converters.artifact.files",
    "verify_manifest": "converters.artifact.files",
    "copy_weight_files": "converters.artifact.files",
    "copy_side_files": "converters.artifact.files",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
