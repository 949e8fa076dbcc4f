import os

from setuptools import find_packages, setup

TEST = [
    "pytest>=8",
    "pytest-xdist>=3.5",  # the suite runs on 2 workers (-n 2): on 2 cores, 8 min instead of 13
    "nbclient>=0.10",  # the test-notebooks run in a real Jupyter kernel
    "nbformat>=5.10",
    "ipykernel>=6.29",
]

# The stacks the suite runs on: each image's torch + torch_xla pair, and the versions it
# ships of every package we import or that shares our dependencies, so the tests see what
# users have. torch_xla X.Y.Z works with torch X.Y.Z only.
KAGGLE = [  # Kaggle's TPU image, Python 3.12 (Kaggle/docker-python tpu/, resolved 2026-03-16)
    "torch==2.8.0", "torch_xla==2.8.0", "torchvision==0.23.0",
    "numpy==2.4.3", "pillow==12.1.1",  # no fastprogress, no fastai
    "transformers==5.3.0",  # unpinned in tpu/requirements.in: the newest on 2026-03-16
]
COLAB = [  # Colab's TPU runtime, Python 3.13 (googlecolab/backend-info pip-freeze.tpu.txt)
    "torch==2.9.0", "torch_xla==2.9.0", "torchvision==0.24.0",
    "numpy==2.1.3", "pillow==12.3.0",
    "fastprogress==1.1.6", "fastcore==2.2.12", "python-fasthtml==0.14.11", "fastai==2.8.8",
    "transformers==5.15.0", "tokenizers==0.22.2", "huggingface_hub==1.27.0", "safetensors==0.8.0",
]

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "README.md"), encoding="utf-8") as f:
    readme = f.read()

setup(
    name="tpu_utility",
    version="0.1.0",
    description="Run a functional PyTorch CUDA script on one TPU core or on all eight.",
    long_description=readme,
    long_description_content_type="text/markdown",
    license="MIT",
    license_files=["LICENSE"],
    packages=find_packages(include=["tpu_utility", "tpu_utility.*"]),
    python_requires=">=3.10",  # tested on 3.10-3.13 (the classifiers); torch_xla has no 3.14 wheels
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Operating System :: POSIX :: Linux",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    # Only what every TPU image already has, unpinned: installing tpu_utility changes no
    # package of Kaggle's or Colab's image. No torch_xla here (a mismatched one breaks the
    # image's pair; it comes with the extras), and no fastprogress: Kaggle's image has none,
    # and 1.1 brings ~25 packages. Progress bars are drawn where it is installed.
    install_requires=[
        "torch",
        "numpy",
        "pillow",
    ],
    extras_require={
        "xla": ["torch_xla"],
        "tpu": ["torch_xla[tpu]"],
        "bars": ["fastprogress>=1.0.3"],
        # tu.plan / TPU_UTILITY_TARGET: the TPU's own compiler (libtpu) through jax's
        # ahead-of-time compile, on any host; the pair checked (jax 0.10.2 pins libtpu 0.0.42).
        "plan": ["jax[tpu]==0.10.2"],
        # The test tools, without a stack: combine with one of the stacks.
        "test": TEST,
        "kaggle": KAGGLE,
        "colab": COLAB,
        # The default development stack: torch_xla 2.9 on Python 3.10-3.13, fastprogress's
        # 1.0 line (the images cover 1.1 and none); torchvision for bench_augment's Kaggle
        # pipeline baseline (0.24.0 is torch 2.9.0's); build and twine make and check the
        # wheel and sdist (.ci/wheel_check); transformers' last 4.x (the images ship 5.x);
        # jax with libtpu for the plan tests (the TPU's compiler, run on this CPU host).
        "dev": TEST + ["torch==2.9.0", "torch_xla==2.9.0", "torchvision==0.24.0",
                       "fastprogress>=1.0.3,<1.1", "build>=1.2", "twine>=5",
                       "transformers==4.57.6", "jax[tpu]==0.10.2"],
    },
)
