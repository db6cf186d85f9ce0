-- Paced requests (see pace.go in pkg/bucket): several token bucket or GCRA
-- rules of one client (one hash tag, so one slot), reserved at one instant
-- within a wait, all or nothing. KEYS the buckets; ARGV[1] the longest wait
-- (ns), then four per bucket: algorithm, capacity, rate (tokens/s), cost.
-- A rule's own wait is d + s - full (d its debt, s the spend, full the
-- capacity's duration); the request waits W, the largest of them, and each
-- rule counts its spend at now + W: its state moves to max(d, W) + s. When
-- any wait is beyond the longest, nothing is written. Replies four values
-- per bucket: allowed, remaining (the ns until full, as the check scripts),
-- retry_us (how long until it fits within the wait), reset_us; then the
-- instant (µs) it decided at and W (ns).
local now = now_us()
local max_wait = tonumber(ARGV[1])
local out, plans, all, W = {}, {}, true, 0
for i = 1, #KEYS do
  local j = 1 + (i - 1) * 4
  local alg = ARGV[j + 1]
  if alg ~= 'token_bucket' and alg ~= 'gcra' then
    return redis.error_reply('algorithm ' .. tostring(alg) .. ' cannot reserve')
  end
  local cap, rate = tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3])
  local d, full = bucket_debt(KEYS[i], cap, rate, now)
  local s = spend_ns(tonumber(ARGV[j + 4]), rate)
  local w = d + s - full
  if w > max_wait then
    all = false
  elseif w > W then
    W = w
  end
  plans[i] = {d, s, w, full}
end
for i = 1, #KEYS do
  local d, s, w = plans[i][1], plans[i][2], plans[i][3]
  if w > max_wait then
    out[#out + 1] = 0
    out[#out + 1] = d
    out[#out + 1] = (w - max_wait + 999) / 1000
    out[#out + 1] = (d + 999) / 1000
  else
    if all then
      d = math.max(d, W) + s
      bucket_write(KEYS[i], now, d, plans[i][4])
    else
      d = d + s
    end
    out[#out + 1] = 1
    out[#out + 1] = d
    out[#out + 1] = 0
    out[#out + 1] = (d + 999) / 1000
  end
end
out[#out + 1] = now
out[#out + 1] = W
return out
