from pathlib import Path

from setuptools import find_packages, setup

version = {}
for line in Path("spec_graph/__init__.py").read_text().splitlines():
    if line.startswith("__version__"):
        exec(line, version)

setup(
    name="spec-graph",
    version=version["__version__"],
    description="Draft-model speculative decoding captured as static graphs, from plain PyTorch",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["spec_graph", "spec_graph.*"]),
    package_data={"spec_graph": ["data/default_pair/*/*"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.11,<2.15",
        "numpy",  # without it torch warns "Failed to initialize NumPy" at import
        "safetensors",
        "tokenizers",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "transformers", "scipy", "triton>=3.6; platform_system == 'Linux'"],
        "vllm": ["vllm>=0.32"],
    },
    entry_points={
        "console_scripts": ["spec-graph = spec_graph.cli:main"],
        "torch_dynamo_backends": ["spec_graph = spec_graph.backend:spec_graph_backend"],
        "vllm.general_plugins": ["spec_graph = spec_graph.vllm_plugin:register"],
    },
)
