from setuptools import find_packages, setup

setup(
    name="tpu_utility",
    version="0.1.0",
    description="Run a functional PyTorch CUDA script on one TPU core or on all eight.",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tpu_utility", "tpu_utility.*"]),
    python_requires=">=3.10",
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
        # The development and test set-up: the exact pair these tests are run against.
        "dev": [
            "torch==2.9.0",
            "torch_xla==2.9.0",
            "pytest>=8",
            "nbclient>=0.10",  # the test-notebooks run in a real Jupyter kernel
            "nbformat>=5.10",
            "ipykernel>=6.29",
        ],
    },
)
