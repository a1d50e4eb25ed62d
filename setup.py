"""Maps the top-level servers/ and clients/ folders to astra.servers and astra.clients.

Everything else about the package is in pyproject.toml.
"""

from setuptools import find_packages, setup

MAPPED = {"servers": "astra.servers", "clients": "astra.clients"}

packages = find_packages(include=["astra", "astra.*"])
package_dir = {"astra": "astra"}
for folder, name in MAPPED.items():
    package_dir[name] = folder
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(where=folder)]

# contracts.binpb: the protos with their comments, for server reflection (tools/codegen.py)
package_data = {"astra": ["py.typed"], "astra.servers": ["contracts.binpb"]}
setup(packages=packages, package_dir=package_dir, package_data=package_data)
