from setuptools import find_packages, setup

TEST = [
    "pytest>=8",
    "nbclient>=0.10",  # the test-notebooks run in a real Jupyter kernel
    "nbformat>=5.10",
    "ipykernel>=6.29",
]

setup(
    name="tpu_utility",
    version="0.1.0",
    description="Run a functional PyTorch CUDA script on one TPU core or on all eight.",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tpu_utility", "tpu_utility.*"]),
    python_requires=">=3.10",  # tested on 3.10-3.13 (the classifiers); torch_xla has no 3.14 wheels
    classifiers=[
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
    ],
    # No torch pin and no torch_xla here: Kaggle and Colab TPU images ship a matched
    # pair, and pip must never replace it. torch_xla comes with the extras.
    install_requires=[
        "torch",
        "numpy",
        "pillow",
        "fastprogress>=1.0.3,<1.1",  # 1.1 pulls in python-fasthtml and ~25 packages
    ],
    extras_require={
        "xla": ["torch_xla"],
        "tpu": ["torch_xla[tpu]"],
        # The test tools, without a stack: combine with one of the stacks below.
        "test": TEST,
        # The stacks the suite runs on (torch_xla X.Y.Z works with torch X.Y.Z only).
        "kaggle": ["torch==2.8.0", "torch_xla==2.8.0"],  # Kaggle's TPU image, Python 3.12
        "colab": ["torch==2.9.0", "torch_xla==2.9.0"],  # Colab's TPU runtime, Python 3.13
        # torchvision: benchmarks/bench_augment.py's baseline is the Kaggle pipeline that
        # uses it (Kaggle's and Colab's images ship it); 0.24.0 is torch 2.9.0's.
        "dev": TEST + ["torch==2.9.0", "torch_xla==2.9.0", "torchvision==0.24.0"],
    },
)
