"""The --json contract: a result checked against the JSON Schema the package ships
(aiofabric/tools/schemas/result.schema.json), and when it fails, what is wrong with it for each form its command has
(the schema's anyOf alone only says that no form fits)."""
import json

from jsonschema import Draft202012Validator

from aiofabric.tools.result_meta import KEYS, SCHEMA

DOCUMENT = json.loads(SCHEMA.read_text())
VALIDATOR = Draft202012Validator(DOCUMENT)
FORMS = [choice["$ref"].rpartition("/")[2] for choice in DOCUMENT["anyOf"]]


def _problems(name, result):
    validator = Draft202012Validator({"$ref": f"#/$defs/{name}", "$defs": DOCUMENT["$defs"]})
    return [f"{name}: {'/'.join(map(str, error.absolute_path)) or 'top'}: {error.message}"
            for error in validator.iter_errors(result)]


def schema_problems(result):
    """What keeps `result` from being a valid --json line (empty: it is one)."""
    if VALIDATOR.is_valid(result):
        return []
    problems = _problems("outcome", result)
    for name in FORMS:
        command = DOCUMENT["$defs"][name].get("properties", {}).get("command")
        if command is None or result.get("command") in command.get("enum", [command.get("const")]):
            problems += _problems(name, result)
    return problems or ["no form of the schema fits"]


def assert_valid(result):
    problems = schema_problems(result)
    assert not problems, "\n".join(problems)


def without_metadata(line):
    """A --json line without the metadata every line has (result_meta.KEYS but "ok"): what its command said."""
    return {key: value for key, value in line.items() if key == "ok" or key not in KEYS}
