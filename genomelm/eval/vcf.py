"""The VCF side of `genomelm variants`: its records read in any form they ship in (plain text, gzip,
bgzip with or without its index; htslib through pysam), each ALT allele with its line, the contig names
matched to the reference's records (a rule, or a map file), and the INFO fields the scored output
declares."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pysam
from isal import igzip

from genomelm.data.errors import space_checked
from genomelm.data.vocab import (
    CODE_TABLE,
    INVALID,
)

# what became of an ALT allele (the outputs' status column)
SCORED, MISMATCH, SYMBOLIC, NO_ALT, TOO_LONG = "scored", "ref_mismatch", "symbolic", "no_alt", "too_long"
MITOCHONDRION = ("chrM", "MT", "M", "chrMT")  # the names references give the mitochondrial genome
INFO_FIELDS = {  # ID: (Number, Type, Description), as the output VCF's header describes them
    "GLM_LLR_BEFORE": (
        "A",
        "Float",
        "log P(ALT window) - log P(REF window) under the model before training, nats, summed over the allele "
        "and the following bases scored (genomelm variants)",
    ),
    "GLM_LLR_AFTER": ("A", "Float", "As GLM_LLR_BEFORE, under the model after training"),
    "GLM_LLR_BEFORE_PER_BASE": (
        "A",
        "Float",
        "Mean log-probability per scored base of the ALT window minus that of the REF window, before "
        "training, nats per base (length-normalised for indels)",
    ),
    "GLM_LLR_AFTER_PER_BASE": ("A", "Float", "As GLM_LLR_BEFORE_PER_BASE, after training"),
    "GLM_SKIPPED": (
        "A",
        "String",
        "Why an ALT allele was not scored: symbolic (<DEL>, *, breakend), ref_mismatch (REF differs from the "
        "reference), too_long (longer than the context); missing where scored",
    ),
    "GLM_SHORT_CONTEXT": (
        "0",
        "Flag",
        "The window held fewer reference bases before (or after) the variant than variant_context and "
        "variant_position ask for: it is near a record's start (or end)",
    ),
}


class VariantError(Exception):
    """Bad variants input (VCF, reference, contig names, settings); the message names the file and line and
    says how to fix it."""

    exit_code = 2  # the user's input (`genomelm.run.failures`)


def contig_rule(contig: str) -> list[str]:
    """Reference record names the VCF contig `contig` may be, in the order tried: itself; then with the
    `chr` prefix added or removed (`20` <-> `chr20`); the mitochondrion's names (chrM, MT, M, chrMT) stand
    for each other."""
    names = [contig, contig[3:] if contig.startswith("chr") else f"chr{contig}"]
    if contig in MITOCHONDRION:
        names += [name for name in MITOCHONDRION if name not in names]
    return [name for name in dict.fromkeys(names) if name]


def read_contig_map(path: str | Path) -> dict[str, str]:
    """A `contig_map=` file: one `VCF-contig record-name` pair per line (whitespace-separated; blank lines and
    `#` comments skipped) -> {VCF contig: reference record}."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise VariantError(f"contig_map={path}: cannot read it ({exc.strerror}); check the path") from None
    mapping: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise VariantError(
                f"{path}, line {number}: {line.strip()!r} has {len(fields)} columns; give two per line: the "
                "VCF's contig name and the reference's record name (e.g. '4 NC_004353.4')"
            )
        if fields[0] in mapping:
            raise VariantError(f"{path}, line {number}: contig {fields[0]!r} is mapped twice; map it once")
        mapping[fields[0]] = fields[1]
    return mapping


def describe_records(lengths: dict[str, int], most: int = 20) -> str:
    """The reference's records with their lengths, the first `most` of them."""
    items = [f"{name} ({length:,} bases)" for name, length in list(lengths.items())[:most]]
    more = len(lengths) - most
    return ", ".join(items) + (f" and {more:,} more" if more > 0 else "")


@dataclass(frozen=True)
class Allele:
    """One ALT allele of a VCF record as read: its VCF line (1-based), record index and ALT index, CHROM,
    POS (1-based), REF and ALT as written, and `status`: None to score, or why it is not scored."""

    line: int
    record: int
    index: int
    contig: str
    pos: int
    ref: str
    alt: str
    status: str | None = None

    @property
    def shared(self) -> int:
        """Leading bases REF and ALT share (an indel's anchor base): context, not allele."""
        n = 0
        while n < min(len(self.ref), len(self.alt)) and self.ref[n].upper() == self.alt[n].upper():
            n += 1
        return n

    @property
    def start(self) -> int:
        """0-based position of the first base that differs."""
        return self.pos - 1 + self.shared

    @property
    def longer(self) -> int:
        """Bases of the longer of the two alleles after the shared leading bases."""
        return max(len(self.ref), len(self.alt)) - self.shared


def is_symbolic(alt: str) -> bool:
    """A symbolic ALT: `<DEL>`-style, the spanning deletion `*`, or a breakend (`G]17:198982]`, `.A`)."""
    return (
        alt.startswith("<")
        or alt == "*"
        or "[" in alt
        or "]" in alt
        or alt.startswith(".")
        or alt.endswith(".")
    )


def codes_of(letters: str) -> np.ndarray:
    """uint8 base codes of `letters` (IUPAC codes as N; INVALID for anything else)."""
    return CODE_TABLE[np.frombuffer(letters.encode("ascii", errors="replace"), dtype=np.uint8)]


def open_text(path: Path) -> BinaryIO:
    """The VCF's lines as bytes, decompressed when it is gzip or BGZF."""
    with open(path, "rb") as handle:
        compressed = handle.read(2) == b"\x1f\x8b"
    return igzip.open(path, "rb") if compressed else open(path, "rb")  # noqa: SIM115 - the caller closes it


def decompressed_copy(path: Path) -> Path:
    """A plain-text copy of the gzip file `path` in the temporary folder (DiskFull when it does not fit)."""
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".vcf")
    copy = Path(name)
    with space_checked(copy, 0, f"the decompressed copy of {path}"):
        try:
            with os.fdopen(handle, "wb") as out, open_text(path) as source:
                shutil.copyfileobj(source, out, 8 << 20)
        except BaseException:
            copy.unlink(missing_ok=True)
            raise
    return copy


def header_lines(path: Path) -> int:
    """Lines of the VCF's header (the `##` lines and the `#CHROM` line): record i (0-based) is on line
    header_lines + i + 1, as htslib refuses blank lines between records."""
    count = 0
    with open_text(path) as handle:
        for line in handle:
            count += 1
            if not line.startswith(b"##"):
                break
    return count


def line_text(path: Path, number: int) -> str:
    """Line `number` (1-based) of the VCF, shortened to 200 characters."""
    with open_text(path) as handle:
        for i, line in enumerate(handle, 1):
            if i == number:
                text = line.decode(errors="replace").rstrip("\n")
                return text if len(text) <= 200 else text[:200] + "..."
    return "(past the end of the file)"


def is_plain_gzip(path: Path) -> bool:
    """Whether `path` is gzip but not BGZF (whose header carries the extra field "BC": htslib's own)."""
    with open(path, "rb") as handle:
        head = handle.read(14)
    return head[:2] == b"\x1f\x8b" and not (head[3:4] == b"\x04" and head[12:14] == b"BC")


def open_vcf(path: Path) -> pysam.VariantFile:
    """The VCF (plain text, gzip, or bgzipped with or without its index) opened for reading, with INFO/END and
    the output's INFO fields declared in its header: htslib writes a record with a symbolic allele only when
    END is declared, and records read after the declarations can carry the scores. htslib cannot open plain
    gzip (it seeks), so such a file is decompressed to a temporary file first (the records are read into
    memory anyway), which is unlinked once opened."""
    if not path.is_file():
        raise VariantError(f"vcf={path}: no such file; give the VCF (.vcf or .vcf.gz) to score")
    quiet = pysam.set_verbosity(0)  # htslib would report a bgzipped VCF's missing tabix index: none is needed
    plain = None
    try:
        if is_plain_gzip(path):
            plain = decompressed_copy(path)
        vcf = pysam.VariantFile(str(plain or path))
    except (OSError, ValueError, EOFError) as exc:
        raise VariantError(
            f"{path}: not a readable VCF ({exc}); check that it is a VCF with a #CHROM header line"
        ) from None
    finally:
        pysam.set_verbosity(quiet)
        if plain is not None:
            plain.unlink(missing_ok=True)
    header = vcf.header
    if "END" not in header.info:
        header.info.add("END", 1, "Integer", "End position of the variant described in this record")
    for key, (number, kind, text) in INFO_FIELDS.items():
        if key not in header.info:  # re-scoring an output of this command keeps its declarations
            header.info.add(key, number, kind, text)
    return vcf


def read_vcf(path: Path, vcf: pysam.VariantFile) -> tuple[list[pysam.VariantRecord], list[Allele]]:
    """Every record of `vcf` (read from `path`) and its ALT alleles; VariantError naming the line of a record
    pysam cannot parse or with alleles that are no bases."""
    first = header_lines(path) + 1
    records: list[pysam.VariantRecord] = []
    alleles: list[Allele] = []
    iterator = iter(vcf)
    while True:
        line = first + len(records)
        try:
            rec = next(iterator)
        except StopIteration:
            break
        except (OSError, ValueError) as exc:
            raise VariantError(
                f"{path}, line {line}: pysam cannot parse this record ({exc}): {line_text(path, line)!r}; "
                "fix the line (tab-separated CHROM POS ID REF ALT QUAL FILTER INFO, declared in the header)"
            ) from None
        if rec.pos < 1:
            raise VariantError(f"{path}, line {line}: POS {rec.pos}; positions are 1-based, give POS >= 1")
        ref = rec.ref or ""
        if not ref or (codes_of(ref) == INVALID).any():
            raise VariantError(
                f"{path}, line {line}: REF {ref!r} is not a sequence of bases; give REF in A C G T N"
            )
        index = len(records)
        records.append(rec)
        if not rec.alts:
            alleles.append(Allele(line, index, 0, rec.contig, rec.pos, ref, ".", NO_ALT))
            continue
        for i, alt in enumerate(rec.alts):
            if is_symbolic(alt):
                status = SYMBOLIC
            elif (codes_of(alt) == INVALID).any():
                raise VariantError(
                    f"{path}, line {line}: ALT {alt!r} is neither bases (A C G T N) nor a symbolic allele "
                    "(<DEL>, *, a breakend); fix the record"
                )
            else:
                status = None
            alleles.append(Allele(line, index, i, rec.contig, rec.pos, ref, alt, status))
    return records, alleles
