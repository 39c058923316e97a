"""Write weir/kafka/jars.sha256: the sha256 of every runtime jar of the pinned Kafka broker.

    python scripts/pin_kafka_jars.py          (needs mvn; `make`-free, run after changing pom.xml)

Maven resolves weir/kafka/pom.xml's runtime dependencies (maven-dependency-plugin:list, the same
resolution launcher.resolve_jars copies), each jar is checked against the .sha1 that Maven fetched
from Maven Central beside it in the local repository, and only then is its sha256 pinned, with the
Maven coordinates the SBOM's purl needs (weir/sbom.py). docs/supply-chain.md.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from weir.kafka import launcher  # noqa: E402

MAVEN_LIST = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:list"


def resolved_artifacts() -> list[tuple[str, Path]]:
    """(group:artifact:version, the jar in the local Maven repository) of every runtime dependency."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "deps.txt"
        subprocess.run(
            [
                "mvn",
                "-B",
                "-q",
                "-f",
                str(launcher.POM),
                MAVEN_LIST,
                "-DincludeScope=runtime",
                "-DoutputAbsoluteArtifactFilename=true",
                f"-DoutputFile={out}",
                f"-Dkafka.version={launcher.KAFKA_VERSION}",
            ],
            check=True,
        )
        lines = out.read_text().splitlines()
    artifacts = []
    for line in lines:
        fields = line.strip().split(" -- ")[0].split(":")
        if len(fields) == 6 and fields[2] == "jar":  # group:artifact:jar:version:scope:/path
            group, artifact, _, version, _, path = fields
            artifacts.append((f"{group}:{artifact}:{version}", Path(path)))
    return artifacts


def main() -> int:
    rows = []
    for coordinates, jar in resolved_artifacts():
        data = jar.read_bytes()
        published = Path(f"{jar}.sha1").read_text().split()[0].strip()
        if hashlib.sha1(data).hexdigest() != published:
            print(f"{jar}: sha1 differs from Maven Central's {published}", file=sys.stderr)
            return 1
        rows.append(f"{hashlib.sha256(data).hexdigest()}  {jar.name}  {coordinates}")
    header = (
        "# The runtime jars of weir/kafka/pom.xml: sha256, file name, Maven group:artifact:version.\n"
        "# Made by scripts/pin_kafka_jars.py (each jar's sha1 checked against Maven Central's);\n"
        "# launcher.resolve_jars refuses a lib dir with a missing, extra or different jar.\n"
        f"# kafka.version {launcher.KAFKA_VERSION}\n"
    )
    launcher.JAR_PINS.write_text(header + "\n".join(sorted(rows, key=lambda r: r.split()[1])) + "\n")
    print(f"pinned {len(rows)} jars in {launcher.JAR_PINS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
