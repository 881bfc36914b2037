"""The spec version this code implements: the IR header, the wire Hello and `dtm --version`
all read it from here."""

SPEC_VERSION: tuple[int, int, int] = (1, 1, 3)  # what each minor added: docs/spec/versions.json
PACKAGE_VERSION = "0.1.0"
