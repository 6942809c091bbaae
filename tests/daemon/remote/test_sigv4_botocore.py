#!/usr/bin/python3
"""ckptd's SigV4 signer (daemon/remote/sigv4.h, through ckpt_sigv4_sign)
against botocore's S3SigV4Auth on varied S3 requests: every Authorization
header must be identical.

Usage: test_sigv4_botocore.py PATH/TO/ckpt_sigv4_sign
Exits 77 (skipped) when botocore is not importable (Debian's python3-boto3).

botocore takes the time from datetime.datetime.utcnow() inside
botocore.auth; the test replaces that module attribute with a datetime whose
utcnow() is fixed, so both signers sign at the same instant. botocore's S3
signer uses the URL's path as it is (no normalization, no second encoding),
so the test encodes the path the way S3 expects (urllib.parse.quote with
'/' and '~' kept) and ckpt_sigv4_sign gets the decoded path: a difference in
encoding shows up as a different signature.
"""

import datetime
import hashlib
import json
import subprocess
import sys
import types
import urllib.parse

try:
    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials
except ImportError as e:  # pragma: no cover
    print(f"SKIP: botocore is not importable ({e})")
    sys.exit(77)

AMZ_DATE = "20261130T123456Z"
FIXED_NOW = datetime.datetime(2026, 11, 30, 12, 34, 56)
ACCESS = "AKIDEXAMPLE0CKPT"
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"


class _FixedDatetime(datetime.datetime):
    @classmethod
    def utcnow(cls):
        return FIXED_NOW


def _case(name, method, endpoint, path, query=None, headers=None, body=b"",
          unsigned=False, token="", region="us-east-1"):
    return dict(name=name, method=method, endpoint=endpoint, path=path,
                query=query or [], headers=headers or {}, body=body,
                unsigned=unsigned, token=token, region=region)


RGW = "http://127.0.0.1:7480"
AWS = "https://s3.eu-west-1.amazonaws.com"
VHOST = "https://ckpt-bucket.s3.eu-west-1.amazonaws.com"

CASES = [
    _case("get object", "GET", RGW, "/ckpt/node-a/layer/00000001.bin"),
    _case("put object", "PUT", RGW, "/ckpt/node-a/step-7/manifest", body=b"manifest bytes"),
    _case("put empty", "PUT", RGW, "/ckpt/empty", body=b""),
    _case("put if absent", "PUT", RGW, "/ckpt/node-a/lease", body=b"x",
          headers={"If-None-Match": "*"}),
    _case("delete", "DELETE", RGW, "/ckpt/node-a/old"),
    _case("head bucket", "HEAD", RGW, "/ckpt"),
    _case("create multipart", "POST", RGW, "/ckpt/big.bin", query=[("uploads", "")]),
    _case("upload part", "PUT", RGW, "/ckpt/big.bin",
          query=[("partNumber", "12"), ("uploadId", "2~Xb/+=ab-_.cd==")],
          body=b"\x00\x01part" * 100),
    _case("complete multipart", "POST", RGW, "/ckpt/big.bin",
          query=[("uploadId", "2~Xb/+=ab")],
          headers={"Content-Type": "application/xml"},
          body=b"<CompleteMultipartUpload><Part><PartNumber>1</PartNumber>"
               b"<ETag>\"abc\"</ETag></Part></CompleteMultipartUpload>"),
    _case("abort multipart", "DELETE", RGW, "/ckpt/big.bin",
          query=[("uploadId", "a/b+c=d")]),
    _case("list v2", "GET", RGW, "/ckpt",
          query=[("list-type", "2"), ("prefix", "node-a/step 1/"), ("max-keys", "1000")]),
    _case("list continuation", "GET", RGW, "/ckpt",
          query=[("list-type", "2"), ("prefix", "ckptd/"),
                 ("continuation-token", "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=+")]),
    _case("key with spaces", "PUT", RGW, "/ckpt/dir with space/a  b", body=b"s"),
    _case("unicode key", "GET", RGW, "/ckpt/caf\u00e9/\u65e5\u672c/\U0001F600"),
    _case("tilde star dollar", "GET", RGW, "/ckpt/a~b*c$d&e=f+g;h,i:j@k!l'm(n)"),
    _case("unsigned payload", "PUT", AWS, "/ckpt-bucket/streamed",
          body=b"not hashed", unsigned=True),
    _case("session token", "GET", AWS, "/ckpt-bucket/k",
          token="FwoGZXIvYXdzEJr//////////wEaDOtoken+/=="),
    _case("virtual hosted", "PUT", VHOST, "/node-b/x.bin", body=b"vh",
          region="eu-west-1"),
    _case("headers trimmed", "PUT", "http://localhost:9000", "/b/k", body=b"h",
          headers={"X-Amz-Meta-Note": "  two   spaces\tand tab  ",
                   "Content-Type": "application/octet-stream"}),
    _case("ipv4 other port", "GET", "http://10.1.2.3:8080", "/b/deep/er/path.bin",
          query=[("versionId", "null")]),
    _case("repeated encoded chars", "GET", RGW, "/ckpt/%41%2F already-percent"),
]


def encoded_url(case):
    path = urllib.parse.quote(case["path"].encode("utf-8"), safe="/~")
    return case["endpoint"] + path


def botocore_sign(case):
    payload_hash = (botocore.auth.UNSIGNED_PAYLOAD if case["unsigned"]
                    else hashlib.sha256(case["body"]).hexdigest())
    request = AWSRequest(method=case["method"], url=encoded_url(case),
                         headers=dict(case["headers"]), data=case["body"],
                         params=list(case["query"]))
    if case["unsigned"]:
        # The switch botocore's S3 client uses to leave the body unhashed.
        request.context["client_config"] = types.SimpleNamespace(
            s3={"payload_signing_enabled": False})
    creds = Credentials(ACCESS, SECRET, case["token"] or None)
    signer = botocore.auth.S3SigV4Auth(creds, "s3", case["region"])
    saved = botocore.auth.datetime
    botocore.auth.datetime = types.SimpleNamespace(datetime=_FixedDatetime)
    try:
        signer.add_auth(request)
    finally:
        botocore.auth.datetime = saved
    return request, payload_hash


def ckpt_sign(binary, case, payload_hash):
    host = urllib.parse.urlsplit(case["endpoint"]).netloc
    headers = dict(case["headers"])
    headers["host"] = host
    request = {
        "method": case["method"], "path": case["path"],
        "query": [list(kv) for kv in case["query"]], "headers": headers,
        "payload_sha256": payload_hash, "region": case["region"],
        "access_key_id": ACCESS, "secret_access_key": SECRET,
        "session_token": case["token"], "amz_date": AMZ_DATE,
    }
    out = subprocess.run([binary], input=json.dumps(request).encode(),
                         capture_output=True, timeout=30, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"ckpt_sigv4_sign failed: {out.stderr.decode()}")
    return json.loads(out.stdout)


def main(argv):
    if len(argv) != 2:
        print(__doc__)
        return 2
    binary = argv[1]
    failures = 0
    for case in CASES:
        request, payload_hash = botocore_sign(case)
        ours = ckpt_sign(binary, case, payload_hash)
        theirs = request.headers["Authorization"]
        problems = []
        if ours["authorization"] != theirs:
            problems.append(f"authorization\n  ckpt:     {ours['authorization']}\n"
                            f"  botocore: {theirs}")
        for name in ("X-Amz-Date", "X-Amz-Content-SHA256", "X-Amz-Security-Token"):
            want = request.headers.get(name)
            got = ours["headers"].get(name.lower())
            if want != got:
                problems.append(f"{name}: ckpt {got!r}, botocore {want!r}")
        if problems:
            failures += 1
            print(f"FAIL {case['name']}: " + "\n".join(problems))
            print("  canonical request (ckpt):\n    " +
                  ours["canonical_request"].replace("\n", "\n    "))
        else:
            print(f"ok   {case['name']}")
    print(f"{len(CASES) - failures}/{len(CASES)} requests signed identically")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
