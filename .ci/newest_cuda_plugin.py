"""Print the newest jax-cuda12-plugin release on the package index not newer than a jaxlib.

Usage: python .ci/newest_cuda_plugin.py JAXLIB_VERSION
"""

import os
import subprocess
import sys

from packaging.version import Version


def main() -> None:
    jaxlib = Version(sys.argv[1])
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "jax-cuda12-plugin"],
        capture_output=True,
        text=True,
        check=True,
        # The listing is pip's normal output: a quiet pip (CI's PIP_QUIET) prints nothing.
        env={key: value for key, value in os.environ.items() if key != "PIP_QUIET"},
    ).stdout
    available = [
        Version(version)
        for line in listing.splitlines()
        if line.startswith("Available versions:")
        for version in line.split(":", 1)[1].split(",")
    ]
    usable = [version for version in available if version <= jaxlib]
    if not usable:
        sys.exit(f"no jax-cuda12-plugin release on the index up to jaxlib {jaxlib}: {listing!r}")
    print(max(usable))


if __name__ == "__main__":
    main()
