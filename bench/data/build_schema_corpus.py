"""Assemble bench/data/schema_corpus.jsonl: real-world JSON Schemas from PyPI packages.

Sources (see bench/data/README.md for licences):
- check-jsonschema 0.39.0 (PyPI wheel): the CI/config schemas it vendors from SchemaStore and the
  projects themselves; only permissively licensed ones under 100 kB (minified).
- jsonschema-specifications: the JSON Schema metaschemas (drafts 3 to 2020-12).
- setuptools: the pyproject.toml [tool.setuptools] and distutils schemas.
- openai (the Python SDK): JSON Schemas of its pydantic response models, the shapes API clients
  ask structured output for.

Usage: pip download --no-deps check-jsonschema==0.39.0 -d /tmp/cj
       python bench/data/build_schema_corpus.py /tmp/cj/check_jsonschema-0.39.0-py3-none-any.whl
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import pkgutil
import sys
import zipfile
from pathlib import Path
from typing import Any, Iterator

OUT = Path(__file__).resolve().parent / "schema_corpus.jsonl"
VENDOR = "check_jsonschema/builtin_schemas/vendor/"
MAX_BYTES = 100_000
# vendored schema -> licence (check-jsonschema's vendor/licenses); the rest are SchemaStore's (Apache-2.0).
VENDOR_LICENSES = {"bitbucket-pipelines": "MIT", "buildkite": "MIT", "changie": "MIT", "gitlab-ci": "MIT",
                   "meltano": "MIT", "readthedocs": "MIT", "taskfile": "MIT", "compose-spec": "Apache-2.0",
                   "citation-file-format": "CC-BY-4.0", "renovate": None, "snapcraft": None}  # None: copyleft, left out
OPENAI_MODELS = 75


def minified(schema: Any) -> str:
    return json.dumps(schema, separators=(",", ":"), sort_keys=True)


def vendored(wheel: str) -> Iterator[dict[str, Any]]:
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(n for n in z.namelist() if n.startswith(VENDOR) and n.endswith(".json")):
            stem = name[len(VENDOR):-5]
            licence = VENDOR_LICENSES.get(stem, "Apache-2.0")
            schema = json.loads(z.read(name))
            if licence is None or len(minified(schema)) > MAX_BYTES:
                continue
            yield {"name": f"schemastore/{stem}", "source": f"check-jsonschema 0.39.0 {name}", "license": licence,
                   "schema": schema}


def package_files(package: str, pattern: str, licence: str) -> Iterator[dict[str, Any]]:
    root = Path(importlib.util.find_spec(package).submodule_search_locations[0])
    for path in sorted(root.rglob(pattern)):
        yield {"name": f"{package}/{path.relative_to(root).parent.name or path.stem}/{path.stem}",
               "source": f"{package} {path.relative_to(root)}", "license": licence,
               "schema": json.loads(path.read_text())}


def openai_models() -> Iterator[dict[str, Any]]:
    import openai
    import pydantic

    found: dict[str, Any] = {}
    for info in pkgutil.walk_packages(openai.types.__path__, "openai.types."):
        module = importlib.import_module(info.name)
        for name, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, pydantic.BaseModel) and obj.__module__ == info.name:
                found.setdefault(f"{info.name}.{name}", obj)
    seen, out = set(), []
    for key in sorted(found):
        try:
            schema = found[key].model_json_schema()
        except Exception:  # a model pydantic cannot describe: not part of the corpus
            continue
        text = minified(schema)
        if 400 <= len(text) <= 20_000 and text not in seen:
            seen.add(text)
            out.append({"name": f"openai/{key.removeprefix('openai.types.')}",
                        "source": f"openai {openai.__version__} pydantic model {key}", "license": "Apache-2.0",
                        "schema": schema})
    step = max(1, len(out) // OPENAI_MODELS)  # an even spread over the SDK's areas
    yield from out[::step][:OPENAI_MODELS]


def main() -> None:
    entries = [*vendored(sys.argv[1]), *package_files("jsonschema_specifications", "metaschema.json", "MIT"),
               *package_files("setuptools", "*.schema.json", "MIT"), *openai_models()]
    with open(OUT, "w") as f:
        for entry in entries:
            f.write(json.dumps(entry, separators=(",", ":")) + "\n")
    print(f"wrote {len(entries)} schemas to {OUT}")


if __name__ == "__main__":
    main()
