"""JSON Schema before the grammar backends see it: normalizing and rewriting what a backend
cannot enforce as written (`normalize`, with `refs`, `negate`, `disjoint`, `arrays`, `numbers`,
`patterns`), regular expressions as automata (`regex_dfa`, `regex_text`, `charsets`), the
keyword tables (`keywords`), the metaschema a schema is checked against (`metaschema`), the
JSON text format (`json_format`), the size limits a request's constraint must keep (`limits`)
and the compile-time budget the rewrites check (`budget`).

Pure Python over dicts and strings: nothing here knows tokenizers, backends or the engine.
"""
