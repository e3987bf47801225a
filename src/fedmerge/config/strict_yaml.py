"""YAML that is read as written: a mapping with a key twice is refused (PyYAML keeps the last, silently)."""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKey(yaml.YAMLError):
    """A mapping names ``key`` twice (``line`` is 1-based: the second occurrence)."""

    def __init__(self, key: object, line: int) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.line = key, line


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may repeat keys on purpose
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, list | dict):  # unhashable: PyYAML's own error follows
                continue
            if key in seen:
                raise DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """``yaml.safe_load``, refusing a mapping that repeats a key
    ([`DuplicateKey`][fedmerge.config.strict_yaml.DuplicateKey])."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
