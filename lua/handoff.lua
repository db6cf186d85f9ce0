-- Hands a pinned key's buckets to its new home region at a topology
-- switch: the old home reads what each counts ('used'), the new home
-- raises its own to count at least that, once per generation ('seed'),
-- and asks whether it did ('seeded'). Mirrors Limit.Used, Limit.Raise and
-- Memory's Seed in pkg/bucket. ARGV[1] is the operation:
--   used: KEYS are buckets; ARGV[2..], three per bucket: algorithm,
--     capacity, rate (tokens/s) or window (µs). Replies the tokens each
--     counts now, as strings.
--   seeded: KEYS[1] is the bucket's seed record; ARGV[2] the generation.
--     Replies {1} when the record holds it or a later one, else {0}.
--   seed: KEYS[1] the seed record, KEYS[2] the bucket; ARGV[2] the
--     generation, ARGV[3] the record's expiry (ms), ARGV[4..7] algorithm,
--     capacity, rate or window, used. Unless seeded at that generation or
--     a later one, debits the bucket by what used counts beyond what it
--     counts itself (never below: a second seed, whose old home refilled,
--     keeps what was spent here since) and writes the record: replies {1};
--     else changes nothing: replies {0}.
local now = now_us()

local function used_of(key, alg, cap, p)
  if alg == 'token_bucket' or alg == 'gcra' then
    local d = bucket_debt(key, cap, p, now)
    return d * p / 1e9
  elseif alg == 'sliding_window' then
    local cur, prev, idx, at = sliding_window_at(key, p, now)
    local f = (at - idx * p) / p
    return math.ceil((prev * (1 - f) + cur) * 1e6) / 1e6
  elseif alg == 'fixed_window' then
    return (fixed_window_at(key, p, now))
  elseif alg == 'sliding_log' then
    local n = redis.pcall('ZCOUNT', key, '(' .. fmt_int(now - p), '+inf')
    if type(n) == 'number' then return n end
  end
  return 0
end

local function seeded(gen)
  local v = tonumber(read_string(KEYS[1]) or '')
  return v ~= nil and v >= gen
end

local op = ARGV[1]
if op == 'used' then
  local out = {}
  for i = 1, #KEYS do
    local j = 2 + (i - 1) * 3
    out[i] = string.format('%.17g', used_of(KEYS[i], ARGV[j], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])))
  end
  return out
elseif op == 'seeded' then
  if seeded(tonumber(ARGV[2])) then return {1} end
  return {0}
elseif op == 'seed' then
  local gen = tonumber(ARGV[2])
  if seeded(gen) then return {0} end
  local debit = debits[ARGV[4]]
  if debit then
    local cap, p = tonumber(ARGV[5]), tonumber(ARGV[6])
    local more = tonumber(ARGV[7]) - used_of(KEYS[2], ARGV[4], cap, p)
    if more > 0 then
      debit(KEYS[2], cap, p, more, now, now, 'moved' .. ARGV[2])
    end
  end
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return {1}
end
return redis.error_reply('handoff: no operation ' .. tostring(op))
