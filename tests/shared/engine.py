"""A child engine for the shared-tier tests: opens a Db with a shared tier, does one thing, prints
its answer as one JSON line.

    engine.py put PATH URL N SEED     store N blocks (tokens from SEED), flush: published
    engine.py get PATH URL N SEED     look the N blocks up and read them; their digest
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import xxhash  # noqa: E402

import kvdb  # noqa: E402
from conftest import LAYOUT, make_blocks  # noqa: E402

KEY_SECRET = b"kvdb-shared-tests-key-secret-32b"


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50000, (n * LAYOUT.block_tokens,), generator=g).tolist()


def open_db(path, url, **kw):
    kw.setdefault("host_bytes", 64 * LAYOUT.page_bytes)
    return kvdb.open(path, layout=LAYOUT, model_id="shared-test", key_secret=KEY_SECRET, shared=url, **kw)


def digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(t.contiguous().view(torch.uint8).numpy())


def main() -> None:
    action, path, url, n, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    with open_db(path, url) as db:
        keys = db.block_keys(tokens(n, seed))
        if action == "put":
            blocks = make_blocks(n, seed)
            db.put_blocks(keys, blocks)
            db.flush()
            out = {"digest": digest(blocks)}
        else:
            found = db.match_prefix(keys)
            out = {"found": found}
            if found:
                buf = torch.empty((found, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
                db.get_blocks(keys[:found], out=buf)
                out["digest"] = digest(buf)
        out["shared"] = db.stats()["shared"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
