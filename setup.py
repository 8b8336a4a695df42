"""Ships the repository's top-level `conf/` inside the wheel as `flaxlm/conf`.

`conf/` stays where a user edits it; an installed `flaxlm-train` finds the copy in its
package (see `flaxlm.cli.train.config_dir`). An editable install maps `flaxlm` onto `src/`,
where there is no copy, so it reads `conf/` itself and edits take effect at once."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")


class BuildPyWithConf(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            target = os.path.join(self.build_lib, "flaxlm", "conf")
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(CONF, target, ignore=shutil.ignore_patterns("__pycache__"))


setup(cmdclass={"build_py": BuildPyWithConf})
