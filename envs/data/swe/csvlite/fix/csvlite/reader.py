"""Read small CSV documents into lists of fields or dicts keyed by the header line."""


def split_line(line: str, sep: str = ",") -> list[str]:
    """Split one line into fields; a field in double quotes may hold ``sep`` and ``""`` (a quote)."""
    fields: list[str] = []
    field: list[str] = []
    quoted = False
    i = 0
    while i < len(line):
        ch = line[i]
        if quoted:
            if ch == '"' and line[i + 1 : i + 2] == '"':
                field.append('"')
                i += 1
            elif ch == '"':
                quoted = False
            else:
                field.append(ch)
        elif ch == '"':
            quoted = True
        elif ch == sep:
            fields.append("".join(field))
            field = []
        else:
            field.append(ch)
        i += 1
    fields.append("".join(field))
    return fields


def read_rows(text: str, sep: str = ",", header: bool = True) -> list:
    """The records of ``text``.

    With ``header`` (the default) the first line names the columns and every record is a dict;
    otherwise every record is a list of fields. Blank lines are skipped, ``\\r\\n`` line endings are
    accepted, and the text may or may not end with a newline.
    """
    lines = text.split("\n")
    rows = []
    for line in lines:
        line = line.rstrip("\r")
        if line.strip():
            rows.append(split_line(line, sep))
    if not header:
        return rows
    if not rows:
        return []
    names = rows[0]
    return [dict(zip(names, row)) for row in rows[1:]]
