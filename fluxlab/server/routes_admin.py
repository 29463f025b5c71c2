"""Operations routes: /health, /metrics (Prometheus), /get_load, /model_info, /get_model_info,
/server_info. The sglang-shaped ones are what sglang-router reads to register and route to a worker."""
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from omegaconf import OmegaConf

from fluxlab.server.openapi import error_responses
from fluxlab.server.served_model import Served

router = APIRouter()


@router.get("/health", responses={200: {"content": {"application/json": {"schema": {"type": "object"}}}},
                                  503: {"description": "The engine stopped",
                                        "content": {"application/json": {"schema": {"type": "object"}}}}})
async def health(served: Served) -> JSONResponse:
    if served.async_engine.alive:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", "error": served.async_engine.error}, status_code=503)


@router.get("/metrics", response_class=Response, responses={
    200: {"description": "Prometheus text exposition format",
          "content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses(401)})
async def prometheus(served: Served) -> Response:
    return Response(served.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/get_load", responses=error_responses(401))
async def get_load(served: Served) -> list[dict]:
    snap, waiting = served.async_engine.snapshot, served.async_engine.num_waiting
    page_size = served.cfg.engine.page_size or served.cfg.decoding.block_length
    # sglang's shape (one entry per DP rank), which sglang-router reads for power_of_two routing;
    # the KV and counter fields are fluxlab's.
    return [{"dp_rank": 0, "num_reqs": snap.num_running + waiting, "num_waiting_reqs": waiting,
             "num_running_reqs": snap.num_running,
             "num_tokens": (snap.kv_total_pages - snap.kv_free_pages) * page_size,
             "kv_free_pages": snap.kv_free_pages, "kv_total_pages": snap.kv_total_pages,
             "total_forwards": snap.total_forwards, "total_generated_tokens": snap.total_generated_tokens,
             "kv_cached_pages": snap.kv_cached_pages,
             "prefix_cache_hit_rate": (snap.prefix_cache_hit_blocks / snap.prefix_cache_queried_blocks
                                       if snap.prefix_cache_queried_blocks else 0.0)}]


@router.get("/model_info", responses=error_responses(401))
@router.get("/get_model_info", responses=error_responses(401))
async def model_info(served: Served) -> dict:
    # sglang-router asks for this when it registers a worker. No model_path on purpose: the
    # router would try to load a tokenizer from it, which HTTP routing does not need.
    return {"served_model_name": served.name, "is_generation": True,
            "max_model_len": served.async_engine.max_model_len}


@router.get("/server_info", responses=error_responses(401))
async def server_info(served: Served) -> dict:
    config = OmegaConf.to_container(served.cfg, resolve=True)
    if config.get("server", {}).get("api_key"):
        config["server"]["api_key"] = "***"  # the resolved config is public; the key is not
    return {"served_model_name": served.name, "max_model_len": served.async_engine.max_model_len,
            "kv_total_pages": served.async_engine.snapshot.kv_total_pages, "config": config}
