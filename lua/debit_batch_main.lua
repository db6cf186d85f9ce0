-- Applies one source region's spends for several clients whose keys are
-- on one Redis Cluster node, each at most once, as debit_main.lua does for
-- one (see debit_client.lua): one call instead of one per client.
-- KEYS[1]: the first client's marker, which routes the call to the node.
-- The other keys are not declared: a script without a shebang line may
-- use keys of other slots of its node, and one of another node raises an
-- error ("non local key") after the clients before it were applied.
-- ARGV[1]: the message's stream sequence; ARGV[2]: the markers' expiry
-- (ms); ARGV[3]: the stream's epoch (its creation, µs); ARGV[4]: the count
-- of clients; then per client: its marker, the count n of its buckets, the
-- n buckets' keys, then five per bucket: algorithm, capacity, rate
-- (tokens/s) or window (µs), amount, the instant (µs) it is debited as of.
-- Replies per client, in order, what debit_main.lua replies for it.
local now = now_us()
local out = {}
local j = 5
for c = 1, tonumber(ARGV[4]) do
  local n = tonumber(ARGV[j + 1])
  out[c] = debit_client(ARGV[j], ARGV[1], ARGV[3], ARGV[2], now, n, ARGV, j + 2, ARGV, j + 2 + n)
  j = j + 2 + 6 * n
end
return out
