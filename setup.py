"""Build hook: generate the protobuf modules before the packages are collected."""
import pathlib
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


class BuildWithProtos(build_py):
    def run(self) -> None:
        sys.path.insert(0, str(ROOT / "protos"))
        import generate

        generate.generate(ROOT)
        # Packages are found before run(); pick up the generated ones too.
        self.packages = sorted(set(self.packages or []) | set(_generated_packages()))
        super().run()


def _generated_packages() -> list[str]:
    return [".".join(p.parent.relative_to(ROOT).parts)
            for p in (ROOT / "podvm_core" / "pb").rglob("__init__.py")]


setup(cmdclass={"build_py": BuildWithProtos})
