"""Is the first host->device copy after idle slow (PCIe link power state), whatever the tensor?"""
import time, torch
n = 8 << 30
host = torch.empty(n, dtype=torch.uint8, pin_memory=True); host.fill_(1)
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
def h2d():
    torch.cuda.synchronize(); t = time.perf_counter(); dev.copy_(host, non_blocking=True); torch.cuda.synchronize()
    return n / (time.perf_counter() - t) / 1e9
print("back-to-back", [round(h2d(), 1) for _ in range(3)])
for idle in (0.1, 0.5, 2.0, 5.0):
    time.sleep(idle); print(f"after {idle} s idle", round(h2d(), 1), "then", round(h2d(), 1))
# idle but the GPU busy with compute (as after a rollout): does compute keep the link up?
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(200): a @ a
print("right after compute", round(h2d(), 1))
time.sleep(2.0); small = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
torch.cuda.synchronize(); t = time.perf_counter(); dev[: 1 << 20].copy_(small); torch.cuda.synchronize()
print("1 MiB warm copy took", round((time.perf_counter() - t) * 1e3, 2), "ms; then 8 GiB", round(h2d(), 1))
