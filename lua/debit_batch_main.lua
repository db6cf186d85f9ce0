-- Applies one source region's spends for several clients whose keys are
-- on one Redis Cluster node, each at most once, as debit_main.lua does for
-- one (see debit_client.lua): one call instead of one per client. The
-- clients may come from several messages of one partition: each carries
-- its message's position, and a client of several messages comes once per
-- message, in their order.
-- KEYS[1]: the first client's marker, which routes the call to the node.
-- The other keys are not declared: a script without a shebang line may
-- use keys of other slots of its node, and one of another node raises an
-- error ("non local key") after the clients before it were applied.
-- ARGV[1]: the markers' expiry (ms); ARGV[2]: the count of clients; then
-- per client: its marker, its message's stream sequence, the stream's
-- epoch (its creation, µs), the count n of its buckets, the n buckets'
-- keys, then six per bucket: algorithm, capacity, rate (tokens/s) or
-- window (µs), amount, the instant (µs) it is debited as of, the last
-- admission (µs, the source's clock; 0: unknown).
-- Replies per client, in order, what debit_main.lua replies for it.
local now = now_us()
local out = {}
local j = 3
for c = 1, tonumber(ARGV[2]) do
  local n = tonumber(ARGV[j + 3])
  out[c] = debit_client(ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[1], now, n, ARGV, j + 4, ARGV, j + 4 + n)
  j = j + 4 + 7 * n
end
return out
