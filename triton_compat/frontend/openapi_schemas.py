"""JSON schemas of the v2 request bodies, for `/openapi.json` (see `api.openapi`).

Reference: KServe v2 REST protocol, "Inference Request JSON Object" (required_api.md), and
Triton's model-repository extension (extension_model_repository.md). The routes validate
bodies themselves; these schemas only document them.
"""

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BYTES", "BF16"]

_TENSOR = {
    "type": "object", "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string", "examples": ["INPUT0"]},
        "shape": {"type": "array", "items": {"type": "integer"}, "examples": [[1, 16]]},
        "datatype": {"type": "string", "enum": DATATYPES},
        "parameters": {"type": "object"},
        "data": {"type": "array"},
    },
}

SCHEMAS = {
    "InferenceRequest": {
        "type": "object", "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object"},
            "inputs": {"type": "array", "items": _TENSOR},
            "outputs": {"type": "array", "items": {
                "type": "object", "required": ["name"],
                "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}}}},
        },
    },
    "RepositoryIndexRequest": {
        "type": "object", "properties": {"ready": {"type": "boolean"}},
    },
}

# (method, path) of each route with a JSON body → its schema's name in SCHEMAS.
BODIES = {
    ("post", "/v2/models/{model}/infer"): "InferenceRequest",
    ("post", "/v2/models/{model}/versions/{version}/infer"): "InferenceRequest",
    ("post", "/v2/repository/index"): "RepositoryIndexRequest",
}
