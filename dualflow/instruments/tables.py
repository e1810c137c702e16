"""The one plain-text table format of the instruments (`compare`, `experiment`)."""


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell, ` | ` between columns, a `-+-` rule under the header."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)
