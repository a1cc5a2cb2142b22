"""spec-graph: draft-model speculative decoding captured as static graphs."""
__version__ = "0.1.0"

_EXPORTS = {
    "SpecGraphConfig": "config",
    "SpecDecoder": "engine",
    "GenerationOutput": "engine",
    "GenerationResult": "engine",
    "GenerationStats": "engine",
    "export_pair": "export",
    "load_exported": "export",
    "ExportedRunner": "export",
    "ExportError": "export",
    "UnsupportedModelError": "models.config",
    "compile": "compile_api",
    "check": "compile_api",
    "HostSyncError": "passes.host_sync",
    "HostSyncReport": "passes.host_sync",
    "SpecGraphWarning": "passes.host_sync",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    # Lazy, so that light entry points (the CLI's parser, plugins) do not import the models.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'spec_graph' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_EXPORTS})
