"""Sets of outbox ids as 64-bit words: one row per 64 consecutive ids that a set has any of.

A word row is `(..., word, bits)`: id `i` is bit `i & 63` of word `i >> 6`. Building the words is
a `bit_or` per (group, word), an aggregate Spark runs with its fast hash aggregation and
partially on each task, so a scan folds its ids into a few words per 64 ids without a shuffle
of the ids. Outbox ids come from one sequence and are dense, so five million ids make about
78,000 words; a sparse set costs one 16-byte word per id at worst. Merging sets is a `bit_or`,
counting is `bit_count`, and ids missing from a set are `expected & ~seen`, all exact.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

SCHEMA = "word long, bits long"


def word_of(outbox_id: Column) -> Column:
    """The word an id belongs to (an arithmetic shift: exact for any long, negative ones too)."""
    return F.shiftright(outbox_id, 6)


def bit_of(outbox_id: Column) -> Column:
    """The id's bit in its word, as a long with that one bit set."""
    return F.call_function("shiftleft", F.lit(1).cast("long"), outbox_id.bitwiseAND(F.lit(63)).cast("int"))


def words(frame: DataFrame, *group: str, column: str = "outbox_id") -> DataFrame:
    """The non-null ids of `frame`'s `column` as words, per `group` columns."""
    ids = frame.where(F.col(column).isNotNull())
    return ids.groupBy(*group, word_of(F.col(column)).alias("word")).agg(
        F.bit_or(bit_of(F.col(column))).alias("bits"))


def merge(frame: DataFrame, *group: str) -> DataFrame:
    """One row per (group, word): the union of the sets in `frame`."""
    return frame.groupBy(*group, "word").agg(F.bit_or("bits").alias("bits"))


def total() -> Column:
    """How many ids the `bits` column's rows hold, as an aggregate."""
    return F.coalesce(F.sum(F.bit_count("bits")), F.lit(0)).cast("bigint")


def contains(bits: Column, outbox_id: Column) -> Column:
    """Whether the word `bits` (of the id's word; null: none) has the id."""
    return F.coalesce(bits.bitwiseAND(bit_of(outbox_id)) != 0, F.lit(False))


def missing(seen: DataFrame, expected: DataFrame, examples: int) -> tuple[int, int, list[int]]:
    """(ids in `expected`, how many of them are not in `seen`, the lowest `examples` of those).

    Both are word sets (`word`, `bits`; any other columns are ignored and the sets merged).
    """
    seen = merge(seen.select("word", "bits")).withColumnRenamed("bits", "seen")
    expected = merge(expected.select("word", "bits"))
    absent = (expected.join(seen, "word", "left")
              .select("word", "bits", F.col("bits").bitwiseAND(F.bitwise_not(F.coalesce("seen", F.lit(0).cast("long"))))
                      .alias("absent")))
    row = absent.agg(total().alias("expected"),
                     F.coalesce(F.sum(F.bit_count("absent")), F.lit(0)).cast("bigint").alias("missing")).collect()[0]
    lowest: list[int] = []
    if row["missing"] and examples:
        for found in absent.where(F.col("absent") != 0).orderBy("word").limit(examples).collect():
            lowest.extend(ids_in(found["word"], found["absent"]))
            if len(lowest) >= examples:
                break
    return row["expected"], row["missing"], lowest[:examples]


def ids_in(word: int, bits: int) -> list[int]:
    """The ids of one word, ascending (bits as Spark returns a long: possibly negative)."""
    bits &= (1 << 64) - 1
    return [(word << 6) + bit for bit in range(64) if bits >> bit & 1]
