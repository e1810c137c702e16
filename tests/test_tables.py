"""tables: the instruments' one text-table format."""

from dualflow.instruments.tables import text_table


def test_text_table_pads_columns_and_rules_the_header():
    table = text_table(["metric", "a", "long name"], [["x", "1.00", "2"], ["longer row", "3", "4.5 (1.10x)"]])
    assert table.splitlines() == [
        "metric     | a    | long name",
        "-----------+------+------------",
        "x          | 1.00 | 2",
        "longer row | 3    | 4.5 (1.10x)",
    ]
