--[[
stager's job_submit/lua: copy a batch script's `#STAGER` lines into the job's
AdminComment, so that the planner (`stager plan`) reads every pending job's
declaration in its one `squeue` call per interval (squeue -O admin_comment) and
never reads a job script or asks Slurm once per job. Users cannot change a job's
AdminComment (only operators and SlurmUser can), so what the planner reads is
what the script said at submit.

The value is "stager1:" followed by the lines without their "#STAGER" word,
joined by ";", each with "%", ";", "|" and control characters written as %XX:
one line of squeue output whatever the script holds. docs/prestaging.md.

Placement: a job that declares data also gets --prefer for the node features that
the node services keep on the nodes holding it (stg_ and 8 hex digits of FNV-1a
32-bit over a line's words; stager/prestage/placement/names.py computes the same), joined by
"&". Not for root's jobs, job arrays, or when the user gave --prefer, and only when slurm.conf
beside this file says SchedulerParameters=ignore_prefer_validation: without it, a
prefer naming a feature no node has yet would reject the submission.

It never fails a submission: any error is logged and the job goes on as
submitted (the job then stages at its start, as without pre-staging). Install:
copy this file beside slurm.conf as job_submit.lua and set
JobSubmitPlugins=lua (append ",lua" to a list you already have).
--]]

local MARK = "stager1:"
-- Bounds what one job can make slurmctld keep and the planner parse.
local MAX_LINES = 32
local MAX_BYTES = 4096

-- "%", ";", "|", control bytes and every byte past ASCII, as %XX: the value is one
-- ASCII line of squeue's output whatever the script holds.
local function escape(text)
	return (text:gsub("[%%;|%c\128-\255]", function(c)
		return string.format("%%%02X", c:byte())
	end))
end

local SPACE, TAB = 32, 9

-- The line without its trailing spaces and tabs. A loop, not a pattern: "(.-)%s*$"
-- backtracks once per space of a run, quadratic in a line the user writes, and this
-- runs inside slurmctld.
local function trim_end(line)
	local last = #line
	while last > 0 do
		local byte = line:byte(last)
		if byte ~= SPACE and byte ~= TAB then
			break
		end
		last = last - 1
	end
	return line:sub(1, last)
end

-- The words of a "#STAGER" line (nil for any other line). Blanks are ASCII spaces and
-- tabs only, as stager-client reads the line (client/declare.py).
local function stager_words(line)
	if line:sub(1, 7) ~= "#STAGER" then
		return nil
	end
	local gap = line:byte(8)
	if gap ~= SPACE and gap ~= TAB then
		return nil
	end
	local first = 9
	while line:byte(first) == SPACE or line:byte(first) == TAB do
		first = first + 1
	end
	return trim_end(line:sub(first))
end

-- The declaration lines of a script, escaped; nil when it has none. Linear in the
-- script: every pattern below matches in one pass.
local function declarations(script)
	local found, words_of, size = {}, {}, 0
	for line in script:gmatch("[^\n]*") do
		-- Only the comment block at the top counts, as for #SBATCH: stop at the first
		-- line that is neither blank nor a comment (stager-client's parser does the same).
		if line:sub(1, 1) ~= "#" and not line:find("^[ \t]*$") then
			break
		end
		-- Past the bound a line cannot be kept anyway: not even looked at.
		local words = #line <= MAX_BYTES and stager_words(line)
		if words and words ~= "" then
			local item = escape(words)
			size = size + #item + 1
			if #found >= MAX_LINES or size > MAX_BYTES then
				slurm.log_info("stager: job script has more than %d #STAGER lines or %d bytes of them; the rest are not pre-staged", MAX_LINES, MAX_BYTES)
				break
			end
			found[#found + 1] = item
			words_of[#words_of + 1] = words
		elseif #line > MAX_BYTES then
			slurm.log_info("stager: a comment line of over %d bytes in a job script is not read for #STAGER", MAX_BYTES)
		end
	end
	if #found == 0 then
		return nil
	end
	return MARK .. table.concat(found, ";"), words_of
end

-- ---- placement: the node feature of a declaration -------------------------------

-- slurmctld links Lua 5.1 (Debian 12): numbers are doubles, with no integer or bit
-- operators. XOR4[a * 16 + b + 1] is a xor b for nibbles, made once at load.
local XOR4 = {}
for a = 0, 15 do
	for b = 0, 15 do
		local x, bit, p, q = 0, 1, a, b
		for _ = 1, 4 do
			if p % 2 ~= q % 2 then
				x = x + bit
			end
			p, q, bit = (p - p % 2) / 2, (q - q % 2) / 2, bit * 2
		end
		XOR4[a * 16 + b + 1] = x
	end
end

local TWO24, TWO32 = 16777216, 4294967296

-- FNV-1a, 32 bits, of a string's bytes. The prime is 2^24 + 403: h * prime mod 2^32 is
-- (h mod 2^8) * 2^24 + h * 403 mod 2^32, whose terms stay below 2^53 (exact in a double).
local function fnv1a(text)
	local h = 2166136261
	for i = 1, #text do
		local low, byte = h % 256, text:byte(i)
		local hi_h, lo_h, hi_b, lo_b = (low - low % 16) / 16, low % 16, (byte - byte % 16) / 16, byte % 16
		h = h - low + XOR4[hi_h * 16 + hi_b + 1] * 16 + XOR4[lo_h * 16 + lo_b + 1]
		h = ((h % 256) * TWO24 + h * 403) % TWO32
	end
	return h
end

local function feature(words)
	return string.format("stg_%08x", fnv1a(words))
end

-- Whether slurm.conf (beside this file) has SchedulerParameters=ignore_prefer_validation,
-- read at most once a minute: a few KiB, and an admin's change is seen without a reload.
local CONF = ((debug.getinfo(1, "S").source or ""):match("^@(.*)/[^/]*$") or "/etc/slurm") .. "/slurm.conf"
local CONF_READ_EVERY_S = 60
local prefer_allowed, conf_read_at = false, nil

local function may_prefer()
	local now = os.time()
	if conf_read_at ~= nil and now - conf_read_at < CONF_READ_EVERY_S then
		return prefer_allowed
	end
	conf_read_at, prefer_allowed = now, false
	local file = io.open(CONF, "r")
	if file == nil then
		return false
	end
	for line in file:lines() do
		-- The last SchedulerParameters line wins, as in slurmctld.
		local value = line:lower():match("^%s*schedulerparameters%s*=%s*(%S*)")
		if value ~= nil then
			prefer_allowed = ("," .. value .. ","):find(",ignore_prefer_validation,", 1, true) ~= nil
		end
	end
	file:close()
	if not prefer_allowed then
		slurm.log_info("stager: %s lacks SchedulerParameters=ignore_prefer_validation; jobs get no --prefer for their data", CONF)
	end
	return prefer_allowed
end

-- The job's prefer: every declaration's feature, joined by "&". Left alone when the
-- user gave one (theirs is what they meant; ANDing ours to it could make it unmet),
-- and for a job array: Slurm 22.05 keeps an array whose prefer no free node meets
-- pending for good (Reason=BadConstraints), where a single job falls back.
local function prefer(job_desc, submit_uid, words_of)
	if submit_uid == 0 or (job_desc.prefer ~= nil and job_desc.prefer ~= "") then
		return
	end
	if job_desc.array_inx ~= nil and job_desc.array_inx ~= "" then
		return
	end
	if not may_prefer() then
		return
	end
	local features = {}
	for i, words in ipairs(words_of) do
		features[i] = feature(words)
	end
	job_desc.prefer = table.concat(features, "&")
end

local function apply(job_desc, submit_uid)
	local current = job_desc.admin_comment
	-- A value that looks like ours and did not come from this script is dropped.
	if current ~= nil and current:sub(1, #MARK) == MARK then
		job_desc.admin_comment = nil
		current = nil
	end
	local script = job_desc.script
	if script == nil then
		return -- srun/salloc: no script, nothing declared
	end
	local value, words_of = declarations(script)
	if value == nil then
		return
	end
	prefer(job_desc, submit_uid, words_of)
	if current ~= nil and current ~= "" then
		slurm.log_info("stager: job has an AdminComment already; its #STAGER lines are not pre-staged")
		return
	end
	job_desc.admin_comment = value
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	local ok, err = pcall(apply, job_desc, submit_uid)
	if not ok then
		slurm.log_error("stager: job_submit.lua: %s (the job goes on without pre-staging)", tostring(err))
	end
	return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	return slurm.SUCCESS
end

slurm.log_info("stager: job_submit.lua loaded")
return slurm.SUCCESS
